"""SGLang's wire shapes on the server side of `agentrl serve`: the `io_struct.py` request bodies,
`sampling_params` parsing, and the finish-reason and error JSON."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from agentrl.engine.base import Completion, FinishReason
from agentrl.http_guard import error_response as error_response  # SGLang's error shape

# ---------------------------------------------------------------- request bodies (io_struct.py)


class UpdateWeightFromDiskReqInput(BaseModel):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightsFromTensorReqInput(BaseModel):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitWeightsUpdateGroupReqInput(BaseModel):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReqInput(BaseModel):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedReqInput(BaseModel):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None  # "flattened_bucket": one broadcast of the whole bucket


class MemoryOccupationReqInput(BaseModel):
    tags: list[str] | None = None


class AbortReq(BaseModel):
    rid: str = ""
    abort_all: bool = False


class UpdateWeightVersionReqInput(BaseModel):
    new_version: str
    abort_all_requests: bool = True  # SGLang 0.5.23's default


class WeightUpdateSessionReqInput(BaseModel):
    """/begin_weight_update and /end_weight_update (SGLang's `selector` is not served here)."""


# ---------------------------------------------------------------- conversions


def finish_reason_json(completion: Completion) -> dict[str, Any]:
    """schedule_batch.py FINISH_*.to_json shapes."""
    if completion.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": len(completion.ids)}
    if completion.finish_reason is FinishReason.ABORT:
        return {"type": "abort", "message": "Aborted by abort_request"}
    return {"type": "stop", "matched": completion.matched_stop}


def generate_error(message: str, status_code: int = 400) -> JSONResponse:
    """http_server.py `_create_error_response`: how SGLang 0.5.23's `/generate` answers a
    request the tokenizer manager refused (a malformed body is an `error_response` instead)."""
    return JSONResponse({"error": {"message": message}}, status_code=status_code)
