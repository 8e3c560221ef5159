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
from agentrl.engine.serve.control import add_control_routes
from agentrl.engine.serve.generate import add_generate_routes
from agentrl.engine.serve.openai import add_openai_routes
from agentrl.engine.serve.protocol import error_response
from agentrl.engine.serve.state import ServerState
from agentrl.engine.serve.weights import add_weight_routes

__all__ = ["create_app", "serve"]


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

    add_generate_routes(app, state)
    add_control_routes(app, state)
    add_weight_routes(app, state)
    add_openai_routes(app, state)
    return app


# ---------------------------------------------------------------- running it


def serve(
    engine: Engine, *, host: str = "127.0.0.1", port: int = 30000, log_level: str = "info"
) -> None:
    """Blocking: serve `engine` until interrupted."""
    import uvicorn

    uvicorn.run(create_app(engine), host=host, port=port, log_level=log_level)
