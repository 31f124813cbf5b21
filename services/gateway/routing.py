"""Which scheduler replica a request goes to, so that each replica's prefix cache keeps its hits.

Every replica caches the prompts it served. With least-loaded routing, n samples of a prompt, or a session's
turns, spread over the replicas and each one computes the prefix again; here they go where it is cached:

- a request with a session key (the X-SMG-Routing-Key header, as SGLang's router; X-Session-ID, as vLLM's)
  goes to the replica its session last went to;
- any other goes to the replica that was last sent the longest prefix of its prompt, known by the hashes
  of the prompt's successive blocks of BLOCK_TOKENS tokens (SGLang's router keeps a tree of texts per worker
  for the same purpose);
- when neither says, or the replica they name is much busier than the least loaded one (BALANCE_ABS and
  BALANCE_REL, SGLang's router's thresholds), to the least loaded one.

What it remembers is bounded (least recently used forgotten first); a replica that leaves rotation is simply
never chosen, so its entries age out.
"""

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Protocol, TypeVar

BLOCK_TOKENS = 64  # a coarser grain than the schedulers' pages: a shorter shared prefix saves little
MAX_BLOCKS = 1 << 18  # block hashes remembered (about 30 MB)
MAX_SESSIONS = 1 << 16
# A replica named by affinity is passed over for the least loaded when it has more than BALANCE_ABS more
# requests outstanding and more than BALANCE_REL times as many.
BALANCE_ABS = 32
BALANCE_REL = 1.5
ROUTING_KEY_HEADERS = ("x-smg-routing-key", "x-session-id")  # HTTP headers and gRPC metadata keys


class RoutingPolicy(StrEnum):
    CACHE_AWARE = "cache_aware"  # session key, then longest prefix, then least loaded
    LEAST_LOADED = "least_loaded"


class Candidate(Protocol):
    address: str

    @property
    def load(self) -> int: ...


C = TypeVar("C", bound=Candidate)


def routing_key(headers: Mapping[str, str]) -> str | None:
    """The session key of a request's HTTP headers or gRPC metadata (lowercase keys), if any."""
    return next((key for name in ROUTING_KEY_HEADERS if (key := headers.get(name))), None)


def block_hashes(input_ids: Sequence[int]) -> list[int]:
    """One hash per whole block of the prompt, each over every token up to the end of its block."""
    hashes, running = [], 0
    for end in range(BLOCK_TOKENS, len(input_ids) + 1, BLOCK_TOKENS):
        running = hash((running, tuple(input_ids[end - BLOCK_TOKENS:end])))
        hashes.append(running)
    return hashes


class _Lru(OrderedDict):
    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.capacity:
            self.popitem(last=False)


class Router:
    def __init__(self, policy: RoutingPolicy):
        self.policy = policy
        self._blocks = _Lru(MAX_BLOCKS)  # block hash -> the address last sent a prompt through that block
        self._sessions = _Lru(MAX_SESSIONS)  # session key -> the address its last request went to
        self.by_affinity = 0  # requests sent where a session or a prefix named (for /get_server_info)
        self.by_load = 0

    def choose(self, candidates: Sequence[C], input_ids: Sequence[int], routing_key: str | None = None) -> C:
        """The replica for this request, among those in rotation (not empty); remembers the choice."""
        least = min(candidates, key=lambda c: c.load)
        if self.policy is RoutingPolicy.LEAST_LOADED:
            return least
        hashes = block_hashes(input_ids)
        named = self._named(candidates, hashes, routing_key)
        chosen = named if named is not None and not _much_busier(named, least) else least
        if chosen is named:
            self.by_affinity += 1
        else:
            self.by_load += 1
        for block in hashes:
            self._blocks.put(block, chosen.address)
        if routing_key:
            self._sessions.put(routing_key, chosen.address)
        return chosen

    def _named(self, candidates: Sequence[C], hashes: list[int], routing_key: str | None) -> C | None:
        by_address = {c.address: c for c in candidates}
        if routing_key and (address := self._sessions.get(routing_key)) in by_address:
            return by_address[address]
        # The deepest block still remembered for a replica in rotation (its shorter prefixes went there too).
        for block in reversed(hashes):
            if (address := self._blocks.get(block)) in by_address:
                return by_address[address]
        return None


def _much_busier(named: Candidate, least: Candidate) -> bool:
    return named.load - least.load > BALANCE_ABS and named.load > BALANCE_REL * least.load
