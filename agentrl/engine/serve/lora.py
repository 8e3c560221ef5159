"""LoRA routes of `agentrl serve`, SGLang 0.5.23's shapes: `/load_lora_adapter_from_tensors` (the
adapter read through the same payload checks as weights, merged into the embedded engine) and
`/unload_lora_adapter`. The embedded engine merges one adapter at a time, so a `/generate` may name
(`lora_path`) the last one loaded, or none."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from agentrl.engine.local import LocalEngine
from agentrl.engine.serve.auth import ADMIN
from agentrl.engine.serve.state import ServerState, State
from agentrl.weights.adapter import AdapterExport
from agentrl.weights.receive import deserialize_named_tensors

router = APIRouter(tags=[ADMIN])


class LoadLoRAAdapterFromTensorsReqInput(BaseModel):
    lora_name: str
    config_dict: dict[str, Any]  # PEFT's adapter_config.json
    serialized_named_tensors: list[str]  # one copy per TP rank; this server is one rank
    pinned: bool = False
    load_format: str | None = None


class UnloadLoRAAdapterReqInput(BaseModel):
    lora_name: str


def _lora_result(s: ServerState, error: str | None = None) -> JSONResponse:
    """SGLang's `LoRAUpdateOutput`: 400 with `success: false` on failure."""
    body = {
        "success": error is None,
        "error_message": error,
        "loaded_adapters": {name: "__tensor__" for name in s.lora_names},
    }
    return JSONResponse(body, status_code=200 if error is None else 400)


@router.post("/load_lora_adapter_from_tensors")
async def load_lora_adapter_from_tensors(
    obj: LoadLoRAAdapterFromTensorsReqInput, s: State
) -> JSONResponse:
    if not isinstance(s.engine, LocalEngine):
        return _lora_result(s, "this server's engine does not load LoRA adapters")
    if obj.lora_name in s.lora_names:
        return _lora_result(
            s, f"Failed to load LoRA adapter {obj.lora_name} because it is already loaded"
        )
    if not obj.serialized_named_tensors:
        return _lora_result(s, "serialized_named_tensors is empty")
    try:
        named = await asyncio.to_thread(
            deserialize_named_tensors, obj.serialized_named_tensors[0], obj.load_format
        )
        adapter = AdapterExport(named, obj.config_dict)
        async with s.weight_lock:
            await s.engine.load_lora_adapter(
                obj.lora_name, adapter, weight_version=s.weight_version
            )
    except Exception as e:
        return _lora_result(s, f"{type(e).__name__}: {e}")
    s.lora_names.add(obj.lora_name)
    return _lora_result(s)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(obj: UnloadLoRAAdapterReqInput, s: State) -> JSONResponse:
    if obj.lora_name not in s.lora_names or not isinstance(s.engine, LocalEngine):
        return _lora_result(s, f"LoRA adapter {obj.lora_name!r} is not loaded")
    async with s.weight_lock:
        await s.engine.unload_lora_adapter(obj.lora_name)
    s.lora_names.discard(obj.lora_name)
    return _lora_result(s)


def check_lora_paths(s: ServerState, lora_path: str | list[str | None] | None) -> None:
    """A `/generate`'s `lora_path` (one, or one per prompt) names the adapter the engine has
    merged, or none; anything else is a ValueError naming it."""
    paths = lora_path if isinstance(lora_path, list) else [lora_path]
    serving = s.engine.adapter.name if isinstance(s.engine, LocalEngine) else None
    for path in paths:
        if path is not None and path != serving:
            raise ValueError(
                f"lora_path={path!r} is not the adapter this server serves ({serving!r}): the "
                "embedded engine merges one adapter at a time; name it, or none"
            )
