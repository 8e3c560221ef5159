"""Weight routes of `agentrl serve`: updates from disk, from tensors (same host), and by broadcast
over a torch.distributed group, plus the weight-version bump."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from agentrl.engine.base import Engine
from agentrl.engine.serve.auth import ADMIN
from agentrl.engine.serve.protocol import (
    DestroyWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
    WeightUpdateSessionReqInput,
)
from agentrl.engine.serve.state import ServerState, State
from agentrl.weights.group import destroy_process_group, init_weights_update_process_group
from agentrl.weights.receive import (
    deserialize_named_tensors,
    load_checkpoint_tensors,
    receive_broadcast,
)


def _weight_result(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"success": success, "message": message, **extra}, status_code=200 if success else 400
    )


router = APIRouter(tags=[ADMIN])  # every weight route is an admin route


async def _load(
    s: ServerState,
    obj: Any,
    read: Callable[[], list[tuple[str, Any]]],
    *,
    failure: str,
    success: str,
    **extra: Any,
) -> JSONResponse:
    """Read the named tensors off the loop (`read`), then load them under the request's
    version; requests in flight end ABORT first when the body says so (as SGLang)."""
    if obj.abort_all_requests:
        await s.abort_all()
    try:
        t0 = time.perf_counter()
        named = await asyncio.to_thread(read)
        t1 = time.perf_counter()
        await s.update_weights(named, obj.weight_version)
        s.add_weight_update_time(receive_s=t1 - t0, load_s=time.perf_counter() - t1)
    except Exception as e:
        return _weight_result(False, f"{failure}: {type(e).__name__}: {e}", **extra)
    if obj.weight_version is not None:
        success += f" Weight version updated to {obj.weight_version}."
    return _weight_result(True, success, **extra)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput, s: State) -> JSONResponse:
    read = functools.partial(load_checkpoint_tensors, obj.model_path)
    failure = f"Failed to update weights from {obj.model_path}"
    return await _load(
        s,
        obj,
        read,
        failure=failure,
        success="Succeeded to update model weights.",
        num_paused_requests=0,
    )


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(
    obj: UpdateWeightsFromTensorReqInput, s: State
) -> JSONResponse:
    if not s.weight_session:
        return _outside_session("update_weights_from_tensor")
    if not obj.serialized_named_tensors:
        return _weight_result(False, "serialized_named_tensors is empty")
    # one entry per TP rank; this server is one rank
    read = functools.partial(
        deserialize_named_tensors, obj.serialized_named_tensors[0], obj.load_format
    )
    return await _load(
        s,
        obj,
        read,
        failure="Failed to update weights from tensor",
        success="Succeeded to update model weights.",
    )


@router.post("/begin_weight_update")
async def begin_weight_update(obj: WeightUpdateSessionReqInput, s: State) -> JSONResponse:
    """Open SGLang 0.5.23's weight-update session; twice in a row is refused."""
    if s.weight_session:
        return _weight_result(
            False, "a weight-update session is already open; call end_weight_update() first"
        )
    s.weight_session = True
    s.last_weight_update_s = {}
    return _weight_result(True, "Success")


@router.post("/end_weight_update")
async def end_weight_update(obj: WeightUpdateSessionReqInput, s: State) -> JSONResponse:
    if not s.weight_session:
        return _weight_result(
            False, "no weight-update session is open; call begin_weight_update() first"
        )
    s.weight_session = False
    return _weight_result(True, "Success")


@router.post("/init_weights_update_group")
async def init_weights_update_group(obj: InitWeightsUpdateGroupReqInput, s: State) -> JSONResponse:
    if obj.rank_offset < 1 or obj.world_size <= obj.rank_offset:
        return _weight_result(
            False,
            f"rank_offset={obj.rank_offset} with world_size={obj.world_size}: rank 0 of a "
            "weight update group is the trainer's, which hosts its store; an engine joins "
            "as 1 <= rank_offset < world_size",
        )
    join = functools.partial(
        init_weights_update_process_group,
        backend=obj.backend,
        master_address=obj.master_address,
        master_port=obj.master_port,
        world_size=obj.world_size,
        rank=obj.rank_offset,
        group_name=obj.group_name,
        timeout_s=s.limits.group_timeout_s,
    )
    try:
        loop = asyncio.get_running_loop()
        s.groups[obj.group_name] = await loop.run_in_executor(s.group_pool, join)
    except Exception as e:
        return _weight_result(
            False, f"Failed to initialize custom process group: {type(e).__name__}: {e}"
        )
    return _weight_result(True, "Succeeded to initialize custom process group.")


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(
    obj: DestroyWeightsUpdateGroupReqInput, s: State
) -> JSONResponse:
    pg = s.groups.pop(obj.group_name, None)
    if pg is None:
        return _weight_result(False, f"no weight update group named {obj.group_name!r}")
    await asyncio.to_thread(destroy_process_group, pg)  # waits for the peers' side of it
    return _weight_result(True, "Succeeded to destroy custom process group.")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(
    obj: UpdateWeightsFromDistributedReqInput, s: State
) -> JSONResponse:
    if not s.weight_session:
        return _outside_session("update_weights_from_distributed")
    pg = s.groups.get(obj.group_name)
    if pg is None:
        return _weight_result(
            False,
            f"no weight update group {obj.group_name!r}; call /init_weights_update_group first",
        )
    device = _broadcast_device(pg, s.engine)
    read = functools.partial(
        receive_broadcast,
        pg,
        obj.names,
        obj.dtypes,
        obj.shapes,
        device,
        load_format=obj.load_format,
    )
    return await _load(
        s,
        obj,
        read,
        failure="Failed to update parameter online",
        success="Succeeded to update parameter online.",
    )


@router.post("/update_weight_version")
async def update_weight_version(obj: UpdateWeightVersionReqInput, s: State) -> JSONResponse:
    if obj.abort_all_requests:  # SGLang's default: requests in flight end ABORT
        await s.abort_all()
    await s.update_weights([], obj.new_version)
    message = f"Weight version updated to {obj.new_version}"
    return _weight_result(True, message, new_version=obj.new_version)


def _outside_session(route: str) -> JSONResponse:
    """SGLang 0.5.23 refuses tensor and broadcast updates outside a weight-update session."""
    return _weight_result(
        False, f"{route} must run between begin_weight_update() and end_weight_update()"
    )


def _broadcast_device(pg: Any, engine: Engine) -> Any:
    import torch.distributed as dist

    model = getattr(engine, "model", None)
    if "nccl" in str(dist.get_backend(pg)).lower() and model is not None:
        return next(model.parameters()).device  # NCCL receives straight into GPU memory
    return "cpu"
