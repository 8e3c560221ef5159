"""Control routes of `agentrl serve`: model/server info and load, flush, abort, pause/continue, and
releasing/resuming memory."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel

from agentrl.engine.base import EngineMemoryError
from agentrl.engine.serve.auth import ADMIN
from agentrl.engine.serve.protocol import AbortReq, MemoryOccupationReqInput, error_response
from agentrl.engine.serve.state import ServerState, State
from agentrl.engine.sglang.protocol import MEMORY_TAGS


class PauseGenerationReqInput(BaseModel):
    """SGLang's body for /pause_generation: `abort` (its default) ends every request;
    `retract` sends running requests back to wait, to go on after /continue_generation from
    their output so far; `in_place` is served as `retract` (this engine cannot hold a batch
    mid-step, so the request's prompt and output are recomputed on continue)."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


SERVER_VERSION = "agentrl-serve/0.1"


router = APIRouter()


@router.get("/model_info")
@router.get("/get_model_info", deprecated=True)  # SGLang 0.5.23's deprecated alias
async def model_info(s: State) -> dict[str, Any]:
    return {
        "model_path": s.model_path,
        "served_model_name": s.served_model_name,
        "tokenizer_path": s.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": str(s.weight_version),
    }


@router.get("/server_info")
@router.get("/get_server_info", deprecated=True)  # SGLang 0.5.23's deprecated alias
async def server_info(s: State) -> dict[str, Any]:
    return {
        "model_path": s.model_path,
        "served_model_name": s.served_model_name,
        "tp_size": 1,
        "dp_size": 1,
        "context_length": s.context_len,
        "version": SERVER_VERSION,
        "internal_states": [_internal_state(s)],
    }


@router.get("/get_load")
async def get_load(s: State) -> list[dict[str, Any]]:
    return [{"dp_rank": 0, "num_reqs": len(s.requests), "num_waiting_reqs": s.num_waiting}]


@router.get("/v1/loads")
async def v1_loads(s: State) -> dict[str, Any]:
    load = {"dp_rank": 0, "num_running_reqs": s.num_running, "num_waiting_reqs": s.num_waiting}
    return {"loads": [load]}


@router.api_route("/flush_cache", methods=["GET", "POST"], tags=[ADMIN])
async def flush_cache(s: State) -> Response:
    # the transformers engine keeps no prefix cache: nothing to flush
    return Response(
        "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
        "waiting requests, the operation will not be performed.)\n",
        status_code=400 if s.requests else 200,
    )


@router.post("/abort_request", tags=[ADMIN])
async def abort_request(obj: AbortReq, s: State) -> Response:
    if obj.abort_all:
        await s.abort_all()
    elif obj.rid in s.requests:
        s.requests[obj.rid].cancel()
    return Response(status_code=200)


@router.post("/pause_generation", tags=[ADMIN])
async def pause_generation(obj: PauseGenerationReqInput, s: State) -> dict[str, str]:
    await s.pause(obj.mode)
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation", tags=[ADMIN])
async def continue_generation(s: State) -> dict[str, str]:
    s.is_running.set()
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.api_route("/release_memory_occupation", methods=["GET", "POST"], tags=[ADMIN])
async def release_memory_occupation(s: State, obj: MemoryOccupationReqInput | None = None) -> Any:
    tags = set(obj.tags if obj and obj.tags is not None else MEMORY_TAGS)
    if unknown := tags - set(MEMORY_TAGS):
        return error_response(f"unknown memory tags {sorted(unknown)}; use {list(MEMORY_TAGS)}")
    if "weights" in tags and "weights" not in s.released_tags:
        await s.engine.release_memory()  # the transformers engine has no standing KV pool
    s.released_tags |= tags
    return None


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"], tags=[ADMIN])
async def resume_memory_occupation(s: State, obj: MemoryOccupationReqInput | None = None) -> Any:
    tags = set(obj.tags if obj and obj.tags is not None else MEMORY_TAGS)
    # The engine gave back weights and KV together (on a "weights" release); each comes back
    # with its own tag, so a colocated sync resumes weights -> sync -> KV cache.
    if tags & s.released_tags & {"weights", "kv_cache"}:
        try:
            await s.engine.resume_memory(sorted(tags & {"weights", "kv_cache"}))
        except EngineMemoryError as e:  # the client raises it again, message intact
            return error_response(str(e), HTTPStatus.INSUFFICIENT_STORAGE)
    s.released_tags -= tags
    return None


def _internal_state(s: ServerState) -> dict[str, Any]:
    return {
        "num_running_reqs": s.num_running,
        "num_waiting_reqs": s.num_waiting,
        "weight_version": str(s.weight_version),
        "released_tags": sorted(s.released_tags),
        # accelerator memory the engine holds (0 on CPU): what a colocated release frees
        "memory_allocated_bytes": int(getattr(s.engine, "device_memory_bytes", lambda: 0)()),
        # release/resume unmap and map pages in place (torch_memory_saver) rather than freeing
        # and re-allocating
        "pausable_memory": bool(getattr(s.engine, "is_memory_pausable", False)),
        # the engine's own time for its last resume, per tag (no HTTP in it)
        "last_resume_s": dict(getattr(s.engine, "last_resume_s", {})),
        "last_weight_update_s": dict(s.last_weight_update_s),
        # the KV cache's size (what a resume maps again) and the room it left
        "kv_cache_bytes": int(getattr(getattr(s.engine, "arena", None), "nbytes", 0)),
        "reserve_bytes": int(getattr(s.engine, "reserve_bytes", 0)),
    }
