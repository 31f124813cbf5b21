"""The Scheduler service's LoRA adapter calls (--enable-lora): LoadLoraAdapter from a PEFT directory or from its
config and safetensors bytes, and UnloadLoraAdapter.

An adapter is read and checked against the model in a worker thread (model/lora_adapter.py), then handed to the
engine thread, which installs it between two steps (engine/lora_registry.py): the running requests lose no step to
the read. Each call returns once the engine applied it; a refusal is `success: false` with the reason, as SGLang
answers.
"""

import asyncio
import json
import logging

from flatwire_wire.control import ControlReply
from flatwire_wire.lora import LoadLoraAdapterRequest, LoraAdapterReply, UnloadLoraAdapterRequest

from services.scheduler.engine.control import LoadAdapter, UnloadAdapter
from services.scheduler.engine.engine import Engine
from services.scheduler.model.lora_adapter import AdapterRefused, LoraAdapter, read_adapter_bytes, read_adapter_dir

LORA_OFF = "LoRA adapters are not served: start the scheduler with --enable-lora"
log = logging.getLogger("flatwire.scheduler")


class LoraCalls:
    """The LoRA half of the Scheduler service (server.py's SchedulerService)."""

    engine: Engine

    async def load_lora_adapter(self, request: LoadLoraAdapterRequest, context) -> LoraAdapterReply:
        if self.engine.adapters is None:
            return LoraAdapterReply(success=False, message=LORA_OFF)
        if not request.lora_name:
            return self._lora_refused("lora_name: must not be empty")
        try:
            adapter = await asyncio.to_thread(self._read, request)
        except AdapterRefused as exc:
            log.warning("LoRA adapter %s refused: %s", request.lora_name, exc)
            return self._lora_refused(str(exc), not_found=exc.not_found)
        adapter.pinned = request.pinned
        return await self._lora_control(LoadAdapter(adapter=adapter, replace=request.replace))

    async def unload_lora_adapter(self, request: UnloadLoraAdapterRequest, context) -> LoraAdapterReply:
        if self.engine.adapters is None:
            return LoraAdapterReply(success=False, message=LORA_OFF)
        return await self._lora_control(UnloadAdapter(name=request.lora_name))

    def _read(self, request: LoadLoraAdapterRequest) -> LoraAdapter:
        """The adapter the request brings or names (blocking: a worker thread)."""
        lora = self.engine.runner.lora
        assert lora is not None  # the engine has adapters
        if request.lora_path:
            return read_adapter_dir(request.lora_name, request.lora_path, lora.features, lora.max_rank, lora.dtype)
        if not request.safetensors:
            raise AdapterRefused("lora_path: give an adapter's directory, or its config and tensors")
        try:
            config = json.loads(request.config_json)
        except ValueError as exc:
            raise AdapterRefused(f"config_dict: not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise AdapterRefused("config_dict: must be an object (adapter_config.json's)")
        return read_adapter_bytes(request.lora_name, config, request.safetensors, lora.features, lora.max_rank,
                                  lora.dtype)

    async def _lora_control(self, command: LoadAdapter | UnloadAdapter) -> LoraAdapterReply:
        reply = await asyncio.wrap_future(self.engine.control(command))
        if isinstance(reply, ControlReply):  # the engine stopped before it applied the command
            return self._lora_refused(reply.message)
        return reply

    def _lora_refused(self, message: str, not_found: bool = False) -> LoraAdapterReply:
        adapters = self.engine.adapters
        return LoraAdapterReply(success=False, message=message, not_found=not_found,
                                loaded=adapters.loaded() if adapters is not None else [])
