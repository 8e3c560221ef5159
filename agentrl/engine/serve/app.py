"""`agentrl serve`: a LocalEngine behind SGLang's native HTTP API (same paths and JSON shapes as
sgl-project/sglang `python/sglang/srt/entrypoints/http_server.py`, request bodies as in
`python/sglang/srt/managers/io_struct.py`), plus OpenAI-compatible routes (`serve.openai`).

Concurrent `/generate` calls are batched by the engine itself. Binds 127.0.0.1 unless told.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from agentrl.engine.base import Engine
from agentrl.engine.serve import control, generate, lora, openai, weights
from agentrl.engine.serve.auth import GuardMiddleware, admin_paths
from agentrl.engine.serve.protocol import error_response
from agentrl.engine.serve.requests import ServerLimits, validation_message
from agentrl.engine.serve.state import ServerState, ToolParser

__all__ = ["create_app", "serve"]


# ---------------------------------------------------------------- the app


def create_app(
    engine: Engine,
    *,
    tokenizer: Any = None,
    model_path: str = "",
    api_key: str | None = None,
    admin_api_key: str | None = None,
    limits: ServerLimits | None = None,
    tool_parser: ToolParser | None = None,
) -> FastAPI:
    """The FastAPI app around `engine` (a LocalEngine: its `.tokenizer` and `.model_path` are used
    when not given). With `api_key`, every route but the health probes wants
    `Authorization: Bearer <api_key>`; with `admin_api_key`, the weight, memory and cache routes
    want that one instead (SGLang's `--api-key` / `--admin-api-key`). With `tool_parser` (the
    caller's ChatCodec.parse: this layer has no codec), chat replies to requests with `tools`
    carry OpenAI's `tool_calls`."""
    limits = limits or ServerLimits()
    tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
    model_path = model_path or str(getattr(engine, "model_path", ""))
    name = os.path.basename(model_path.rstrip("/")) or "agentrl"
    app = FastAPI(title="agentrl serve", exception_handlers={RequestValidationError: _bad_request})
    # asyncio (3.10+) binds its events and locks to a loop at their first wait, not at creation
    app.state.sglang = ServerState(
        engine, tokenizer, model_path, name, limits=limits, tool_parser=tool_parser
    )
    routers = [module.router for module in (generate, control, weights, lora, openai)]
    for router in routers:
        app.include_router(router)
    app.add_middleware(
        GuardMiddleware,
        admin_paths=admin_paths(routers),
        api_key=api_key or None,
        admin_api_key=admin_api_key or None,
        max_body_bytes=limits.max_body_bytes,
    )
    return app


async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    # SGLang answers a malformed body with 400, not FastAPI's 422.
    return error_response(validation_message(list(exc.errors())))


# ---------------------------------------------------------------- running it


def serve(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    log_level: str = "info",
    **app_options: Any,
) -> None:
    """Blocking: serve `engine` until interrupted; `app_options` are `create_app`'s."""
    import uvicorn

    uvicorn.run(create_app(engine, **app_options), host=host, port=port, log_level=log_level)
