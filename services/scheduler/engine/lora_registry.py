"""The LoRA adapters a scheduler serves, by name (--enable-lora): loaded at start (--lora-paths) and at run time
(LoadLoraAdapter, UnloadLoraAdapter: engine/control.py's commands, applied between two steps), bounded in memory.

A request names its adapter when it is submitted and holds that adapter (LoraAdapter.users) until it ends. Unloading
an adapter, or replacing it (a load under its name with `replace`, vLLM's load_inplace), retires it at once: new
requests get the new one or are refused by name, while those that hold it run on to their end on its weights. Once
none does, its device slot (model/lora.py) and its prefix-cache namespace go: every request's KV is cached under
(its adapter's load id, its cache namespace) (`cache_namespace`), so KV of one adapter, or of an adapter's earlier
weights, never serves a request on another.

Loaded adapters are bounded (--max-loaded-loras): a load past the bound unloads the least recently used adapter that
no request holds and that is not pinned, or is refused when every one is.
"""

import logging
import time
from collections.abc import Callable, Hashable

from flatwire_wire.lora import LoraAdapterInfo, LoraAdapterReply

from services.scheduler.engine.control import LoadAdapter, UnloadAdapter
from services.scheduler.model.lora_adapter import LoraAdapter

log = logging.getLogger(__name__)

BASE = 0  # the adapter id of the base model in a cache namespace


def cache_namespace(adapter: LoraAdapter | None, namespace: str) -> tuple[int, str]:
    """The prefix-cache namespace of a request on `adapter` (None: the base model) with the client's `namespace`
    (vLLM's cache_salt, SGLang's extra_key)."""
    return (BASE if adapter is None else adapter.id, namespace)


def of_adapter(namespace: Hashable, adapter: LoraAdapter) -> bool:
    """Whether a prefix-cache namespace is one of `adapter`'s."""
    return isinstance(namespace, tuple) and namespace[0] == adapter.id


class LoraRegistry:
    def __init__(self, max_loaded: int, forget: Callable[[LoraAdapter], None]):
        """`max_loaded`: adapters loaded at once; `forget(adapter)`: a retired adapter no request holds any more
        leaves the device slots and the prefix cache."""
        self.max_loaded = max_loaded
        self._forget = forget
        # Replaced whole by the engine thread (never changed in place), so that `lookup` on the server's thread
        # reads one state or the next.
        self._by_name: dict[str, LoraAdapter] = {}
        self._retired: list[LoraAdapter] = []

    # -- any thread --

    def lookup(self, name: str) -> LoraAdapter | None:
        return self._by_name.get(name)

    def loaded(self) -> list[LoraAdapterInfo]:
        return [LoraAdapterInfo(name=a.name, path=a.path, pinned=a.pinned, rank=a.rank)
                for a in self._by_name.values()]

    # -- the engine thread (or before it starts) --

    def apply(self, command: LoadAdapter | UnloadAdapter) -> None:
        match command:
            case LoadAdapter():
                reply = self.load(command.adapter, command.replace)
            case UnloadAdapter():
                reply = self.unload(command.name)
        command.done.set_result(reply)

    def load(self, adapter: LoraAdapter, replace: bool = False) -> LoraAdapterReply:
        old = self._by_name.get(adapter.name)
        if old is not None and not replace:
            return self._reply(False, f"The LoRA adapter '{adapter.name}' is already loaded; unload it first (or "
                                      "replace it: vLLM's load_inplace).")
        names = dict(self._by_name)
        evicted = []
        if old is None:
            while len(names) >= self.max_loaded:
                idle = [a for a in names.values() if not a.users and not a.pinned]
                if not idle:
                    return self._reply(False, f"LoRA adapter '{adapter.name}' not loaded: {len(names)} adapters are "
                                              "loaded (--max-loaded-loras) and every one is pinned or running")
                victim = min(idle, key=lambda a: a.last_use)
                del names[victim.name]
                evicted.append(victim)
        else:
            evicted.append(old)
        adapter.last_use = time.monotonic()
        names[adapter.name] = adapter
        self._by_name = names
        for retired in evicted:
            self._retire(retired)
        what = "replaced" if old is not None else "loaded"
        unloaded = f"; unloaded the least recently used {', '.join(a.name for a in evicted)}" if old is None and \
            evicted else ""
        log.info("LoRA adapter %s %s (rank %d, %d modules, %.1f MiB)%s", adapter.name, what, adapter.rank,
                 len(adapter.weights), adapter.bytes / 2**20, unloaded)
        return self._reply(True, f"LoRA adapter '{adapter.name}' {what}{unloaded}.")

    def unload(self, name: str) -> LoraAdapterReply:
        adapter = self._by_name.get(name)
        if adapter is None:
            return self._reply(False, f"The LoRA adapter '{name}' cannot be found.", not_found=True)
        self._by_name = {key: value for key, value in self._by_name.items() if key != name}
        self._retire(adapter)
        log.info("LoRA adapter %s unloaded%s", name,
                 f" (its {adapter.users} requests run on to their end)" if adapter.users else "")
        return self._reply(True, f"LoRA adapter '{name}' unloaded.")

    def _retire(self, adapter: LoraAdapter) -> None:
        adapter.retired = True
        self._retired.append(adapter)
        self.collect()

    def collect(self) -> None:
        """Retired adapters that no request holds any more leave the device slots and the prefix cache."""
        if not self._retired:
            return
        for adapter in [a for a in self._retired if not a.users]:
            self._retired.remove(adapter)
            self._forget(adapter)

    def _reply(self, success: bool, message: str, not_found: bool = False) -> LoraAdapterReply:
        return LoraAdapterReply(success=success, message=message, not_found=not_found, loaded=self.loaded())
