"""`agentrl serve`: a LocalEngine behind SGLang's native HTTP API (same paths and JSON shapes as
sgl-project/sglang `python/sglang/srt/entrypoints/http_server.py`, request bodies as in
`python/sglang/srt/managers/io_struct.py`), plus OpenAI-compatible routes (`openai_routes`).

Concurrent `/generate` calls are batched by the engine itself. Binds 127.0.0.1 unless told.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from agentrl.engine.base import Completion, Engine, FinishReason, SamplingParams
from agentrl.engine.weight_transport import (
    deserialize_named_tensors,
    destroy_process_group,
    init_weights_update_process_group,
    load_checkpoint_tensors,
    receive_broadcast,
)

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
SERVER_VERSION = "agentrl-serve/0.1"


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


class MemoryOccupationReqInput(BaseModel):
    tags: list[str] | None = None


class AbortReq(BaseModel):
    rid: str = ""
    abort_all: bool = False


class UpdateWeightVersionReqInput(BaseModel):
    new_version: str
    abort_all_requests: bool = False


# ---------------------------------------------------------------- conversions


def sampling_from_sglang(params: dict[str, Any] | None) -> SamplingParams:
    """SGLang `sampling_params` -> SamplingParams (the inverse of `SamplingParams.to_sglang`)."""
    p = params or {}
    defaults = SamplingParams()
    stop = p.get("stop") or []
    return SamplingParams(
        temperature=float(p.get("temperature", defaults.temperature)),
        top_p=float(p.get("top_p", defaults.top_p)),
        top_k=int(p.get("top_k", defaults.top_k)),
        max_new_tokens=int(p.get("max_new_tokens", 128)),  # SGLang's default
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=list(p.get("stop_token_ids") or []),
        seed=p.get("sampling_seed"),
    )


def finish_reason_json(completion: Completion) -> dict[str, Any]:
    """schedule_batch.py FINISH_*.to_json shapes."""
    if completion.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": len(completion.ids)}
    if completion.finish_reason is FinishReason.ABORT:
        return {"type": "abort", "message": "Aborted by abort_request"}
    return {"type": "stop", "matched": completion.matched_stop}


def error_response(message: str, status_code: int = 400) -> JSONResponse:
    """http_server.py `_create_error_response` / ErrorResponse shape."""
    kind = "Bad Request" if status_code == 400 else "Internal Server Error"
    return JSONResponse(
        {"object": "error", "message": message, "type": kind, "param": None, "code": status_code},
        status_code=status_code,
    )


def _weight_result(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"success": success, "message": message, **extra}, status_code=200 if success else 400
    )


# ---------------------------------------------------------------- server state


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Any
    model_path: str
    served_model_name: str
    is_running: asyncio.Event = field(default_factory=asyncio.Event)  # cleared by pause_generation
    requests: dict[str, asyncio.Future[Completion]] = field(default_factory=dict)
    waiters: set[asyncio.Future[Any]] = field(
        default_factory=set
    )  # requests held by pause_generation
    released_tags: set[str] = field(default_factory=set)
    groups: dict[str, Any] = field(default_factory=dict)
    weight_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.is_running.set()

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return (
            self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            if self.tokenizer
            else ""
        )

    async def run(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Completion:
        """One generation, honouring pause and abort. The whole request (its wait while paused, then
        the engine call) is one task under `rid`, so `abort_request {rid}` can end it anywhere."""
        if "weights" in self.released_tags:
            raise ValueError(
                "weights are released (release_memory_occupation); call /resume_memory_occupation first"
            )
        request = asyncio.ensure_future(self._wait_then_generate(input_ids, sampling))
        self.requests[rid] = request
        try:
            return await asyncio.shield(request)
        except asyncio.CancelledError:
            if not request.cancelled():  # the HTTP client went away
                request.cancel()
                raise
            return Completion([], [], FinishReason.ABORT, self.weight_version)
        finally:
            self.requests.pop(rid, None)

    async def _wait_then_generate(
        self, input_ids: list[int], sampling: SamplingParams
    ) -> Completion:
        waiter = asyncio.ensure_future(self.is_running.wait())
        self.waiters.add(waiter)
        try:
            await waiter  # cancelled by abort_all: the request task ends cancelled -> ABORT
        finally:
            self.waiters.discard(waiter)
        return await self.engine.generate(input_ids, sampling)

    @property
    def num_waiting(self) -> int:
        return len(self.waiters)

    @property
    def num_running(self) -> int:
        return len(self.requests) - self.num_waiting

    async def abort_all(self) -> None:
        """Running requests return ABORT with their ids so far (the engine ends them); requests
        still waiting behind pause_generation return ABORT at once."""
        for waiter in list(self.waiters):
            waiter.cancel()
        await self.engine.abort()

    async def update_weights(
        self, named_tensors: list[tuple[str, Any]], weight_version: str | None
    ) -> None:
        async with self.weight_lock:
            await self.engine.update_weights(
                named_tensors, weight_version=weight_version or self.weight_version
            )


def generate_response(
    state: ServerState,
    completion: Completion,
    rid: str,
    *,
    prompt_len: int,
    return_logprob: bool,
    skip_special_tokens: bool,
    started: float,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason_json(completion),
        "prompt_tokens": prompt_len,
        "weight_version": completion.weight_version,
        "completion_tokens": len(completion.ids),
        "cached_tokens": completion.cached_tokens,
        "e2e_latency": time.perf_counter() - started,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, i, None] for lp, i in zip(completion.logprobs, completion.ids, strict=False)
        ]
    text = state.decode(completion.ids, skip_special_tokens=skip_special_tokens)
    return {"text": text, "output_ids": completion.ids, "meta_info": meta}


# ---------------------------------------------------------------- the app


def create_app(
    engine: Engine,
    *,
    tokenizer: Any = None,
    model_path: str = "",
    served_model_name: str | None = None,
) -> FastAPI:
    """The FastAPI app around `engine` (a LocalEngine: its `.tokenizer` and `.model_path` are used
    when not given)."""
    tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
    model_path = model_path or str(getattr(engine, "model_path", ""))
    name = served_model_name or os.path.basename(model_path.rstrip("/")) or "agentrl"
    app = FastAPI(title="agentrl serve")
    app.state.sglang = None

    def state() -> ServerState:
        if app.state.sglang is None:  # asyncio primitives must be made inside the serving loop
            app.state.sglang = ServerState(engine, tokenizer, model_path, name)
        return app.state.sglang

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # SGLang answers a malformed body with 400, not FastAPI's 422.
        return error_response(f"invalid request body: {exc.errors()}")

    _add_generate_routes(app, state)
    _add_control_routes(app, state)
    _add_weight_routes(app, state)
    from agentrl.engine.openai_routes import add_openai_routes

    add_openai_routes(app, state)
    return app


def _add_generate_routes(app: FastAPI, state: Any) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(body: dict[str, Any] = Body(...)) -> Any:
        s: ServerState = state()
        if body.get("stream"):
            return error_response(
                "stream=true is not supported by agentrl serve; send stream=false"
            )
        input_ids = body.get("input_ids")
        if input_ids is None and body.get("text") is not None:
            text = body["text"]
            input_ids = (
                [s.tokenizer.encode(t, add_special_tokens=False) for t in text]
                if isinstance(text, list)
                else s.tokenizer.encode(text, add_special_tokens=False)
            )
        elif body.get("text") is not None:
            return error_response("text and input_ids cannot be provided at the same time")
        if not input_ids:
            return error_response("input_ids (or text) is required and must be non-empty")
        is_batch = isinstance(input_ids[0], list)
        batch = input_ids if is_batch else [input_ids]
        params = body.get("sampling_params") or {}
        params_list = params if isinstance(params, list) else [params] * len(batch)
        rid = body.get("rid") or uuid.uuid4().hex
        rids = (
            rid
            if isinstance(rid, list)
            else ([f"{rid}-{i}" for i in range(len(batch))] if is_batch else [rid])
        )
        started = time.perf_counter()
        try:
            completions = await asyncio.gather(
                *(
                    s.run([int(t) for t in ids], sampling_from_sglang(p), r)
                    for ids, p, r in zip(batch, params_list, rids, strict=False)
                )
            )
        except ValueError as e:
            return error_response(str(e))
        except Exception as e:  # the engine failed: a 5xx the client may retry
            return error_response(f"{type(e).__name__}: {e}", status_code=500)
        outs = [
            generate_response(
                s,
                c,
                r,
                prompt_len=len(ids),
                return_logprob=bool(body.get("return_logprob")),
                skip_special_tokens=bool(p.get("skip_special_tokens", True)),
                started=started,
            )
            for c, ids, p, r in zip(completions, batch, params_list, rids, strict=False)
        ]
        # JSONResponse directly: FastAPI's encoder walk over every logprob pair costs more than the
        # model step for short generations.
        return JSONResponse(outs if is_batch else outs[0])

    @app.get("/health")
    @app.get("/health_generate")
    async def health_generate() -> Response:
        s: ServerState = state()
        if "weights" in s.released_tags:
            return Response(status_code=503)
        if s.requests:  # already generating: that proves health (as SGLang does)
            return Response(status_code=200)
        try:
            probe = SamplingParams(temperature=0.0, max_new_tokens=1)
            await asyncio.wait_for(s.engine.generate([0], probe), timeout=20.0)
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)


def _add_control_routes(app: FastAPI, state: Any) -> None:
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        s: ServerState = state()
        return {
            "model_path": s.model_path,
            "tokenizer_path": s.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": s.weight_version,
        }

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": state().weight_version}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        s: ServerState = state()
        return {
            "model_path": s.model_path,
            "served_model_name": s.served_model_name,
            "tp_size": 1,
            "dp_size": 1,
            "weight_version": s.weight_version,
            "version": SERVER_VERSION,
            "internal_states": [
                {
                    "num_running_reqs": s.num_running,
                    "num_waiting_reqs": s.num_waiting,
                    "released_tags": sorted(s.released_tags),
                }
            ],
        }

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        s: ServerState = state()
        return [
            {
                "dp_rank": 0,
                "num_reqs": len(s.requests),
                "num_waiting_reqs": s.num_waiting,
            }
        ]

    @app.get("/v1/loads")
    async def v1_loads() -> dict[str, Any]:
        s: ServerState = state()
        return {
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": s.num_running,
                    "num_waiting_reqs": s.num_waiting,
                }
            ]
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        s: ServerState = state()  # the transformers engine keeps no prefix cache: nothing to flush
        return Response(
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n",
            status_code=400 if s.requests else 200,
        )

    @app.post("/abort_request")
    async def abort_request(obj: AbortReq) -> Response:
        s: ServerState = state()
        if obj.abort_all:
            await s.abort_all()
        elif obj.rid in s.requests:
            s.requests[obj.rid].cancel()
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation() -> dict[str, str]:
        state().is_running.clear()  # new requests wait; running ones finish
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, str]:
        state().is_running.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(obj: MemoryOccupationReqInput | None = None) -> Any:
        s: ServerState = state()
        tags = set(obj.tags if obj and obj.tags is not None else MEMORY_TAGS)
        if unknown := tags - set(MEMORY_TAGS):
            return error_response(f"unknown memory tags {sorted(unknown)}; use {list(MEMORY_TAGS)}")
        if "weights" in tags and "weights" not in s.released_tags:
            await s.engine.release_memory()  # the transformers engine has no standing KV pool
        s.released_tags |= tags
        return None

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(obj: MemoryOccupationReqInput | None = None) -> Any:
        s: ServerState = state()
        tags = set(obj.tags if obj and obj.tags is not None else MEMORY_TAGS)
        if "weights" in tags and "weights" in s.released_tags:
            await s.engine.resume_memory()
        s.released_tags -= tags
        return None


def _add_weight_routes(app: FastAPI, state: Any) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput) -> JSONResponse:
        s: ServerState = state()
        try:
            named = await asyncio.to_thread(load_checkpoint_tensors, obj.model_path)
            await s.update_weights(named, obj.weight_version)
        except Exception as e:
            return _weight_result(
                False, f"Failed to update weights from {obj.model_path}: {e}", num_paused_requests=0
            )
        return _weight_result(
            True,
            _succeeded("Succeeded to update model weights.", obj.weight_version),
            num_paused_requests=0,
        )

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(obj: UpdateWeightsFromTensorReqInput) -> JSONResponse:
        s: ServerState = state()
        if not obj.serialized_named_tensors:
            return _weight_result(False, "serialized_named_tensors is empty")
        try:  # one entry per TP rank; this server is one rank
            named = await asyncio.to_thread(
                deserialize_named_tensors, obj.serialized_named_tensors[0], obj.load_format
            )
            await s.update_weights(named, obj.weight_version)
        except Exception as e:
            return _weight_result(
                False, f"Failed to update weights from tensor: {type(e).__name__}: {e}"
            )
        return _weight_result(
            True, _succeeded("Succeeded to update model weights.", obj.weight_version)
        )

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(obj: InitWeightsUpdateGroupReqInput) -> JSONResponse:
        s: ServerState = state()
        try:
            s.groups[obj.group_name] = await asyncio.to_thread(
                init_weights_update_process_group,
                backend=obj.backend,
                master_address=obj.master_address,
                master_port=obj.master_port,
                world_size=obj.world_size,
                rank=obj.rank_offset,
                group_name=obj.group_name,
            )
        except Exception as e:
            return _weight_result(
                False, f"Failed to initialize custom process group: {type(e).__name__}: {e}"
            )
        return _weight_result(True, "Succeeded to initialize custom process group.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(obj: DestroyWeightsUpdateGroupReqInput) -> JSONResponse:
        pg = state().groups.pop(obj.group_name, None)
        if pg is None:
            return _weight_result(False, f"no weight update group named {obj.group_name!r}")
        destroy_process_group(pg)
        return _weight_result(True, "Succeeded to destroy custom process group.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(
        obj: UpdateWeightsFromDistributedReqInput,
    ) -> JSONResponse:
        s: ServerState = state()
        pg = s.groups.get(obj.group_name)
        if pg is None:
            return _weight_result(
                False,
                f"no weight update group {obj.group_name!r}; call /init_weights_update_group first",
            )
        try:
            named = await asyncio.to_thread(
                receive_broadcast,
                pg,
                obj.names,
                obj.dtypes,
                obj.shapes,
                _broadcast_device(pg, s.engine),
            )
            await s.update_weights(named, obj.weight_version)
        except Exception as e:
            return _weight_result(
                False, f"Failed to update parameter online: {type(e).__name__}: {e}"
            )
        return _weight_result(
            True, _succeeded("Succeeded to update parameter online.", obj.weight_version)
        )

    @app.post("/update_weight_version")
    async def update_weight_version(obj: UpdateWeightVersionReqInput) -> JSONResponse:
        await state().update_weights([], obj.new_version)
        return JSONResponse(
            {
                "success": True,
                "message": f"Weight version updated to {obj.new_version}",
                "new_version": obj.new_version,
            }
        )


def _succeeded(message: str, weight_version: str | None) -> str:
    return (
        f"{message} Weight version updated to {weight_version}."
        if weight_version is not None
        else message
    )


def _broadcast_device(pg: Any, engine: Engine) -> Any:
    import torch.distributed as dist

    model = getattr(engine, "model", None)
    if "nccl" in str(dist.get_backend(pg)).lower() and model is not None:
        return next(model.parameters()).device  # NCCL receives straight into GPU memory
    return "cpu"


# ---------------------------------------------------------------- running it


def serve(
    engine: Engine, *, host: str = "127.0.0.1", port: int = 30000, log_level: str = "info"
) -> None:
    """Blocking: serve `engine` until interrupted."""
    import uvicorn

    uvicorn.run(create_app(engine), host=host, port=port, log_level=log_level)


@dataclass
class ServerThread:
    """`agentrl serve` in a background thread (tests, benchmarks); `.url`, `.stop()`."""

    url: str
    server: Any
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server_thread(
    engine: Engine, *, host: str = "127.0.0.1", port: int = 0, **app_kwargs: Any
) -> ServerThread:
    return run_app_in_thread(create_app(engine, **app_kwargs), host=host, port=port)


def run_app_in_thread(app: Any, *, host: str = "127.0.0.1", port: int = 0) -> ServerThread:
    """Any ASGI app under uvicorn in a daemon thread, on a port bound before it starts (0 = free)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="agentrl-serve"
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"server thread did not start on {host}:{sock.getsockname()[1]}")
        time.sleep(0.01)
    return ServerThread(f"http://{host}:{sock.getsockname()[1]}", server, thread)
