"""The retrieval server behind `agentrl retriever serve`: Search-R1's `POST /retrieve` API over
one BM25 index, so several rollout workers share it. With an API key, every route but `/health`
wants `Authorization: Bearer <key>` (as `agentrl serve` and SGLang do); bodies, `topk` and the
queries per call are bounded, and a bad request is a 400 naming the field."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl_envs.search_r1.bm25 import BM25Index
from pydantic import BaseModel, Field


@dataclass(frozen=True)
class RetrieverLimits:
    """What one `/retrieve` call may ask (`agentrl retriever serve --help` names the flags)."""

    max_topk: int = 100
    max_queries: int = 512
    max_body_bytes: int = 4 * 2**20


class QueryRequest(BaseModel):
    """Search-R1's request body (module level: FastAPI resolves the annotations here)."""

    queries: list[str]
    topk: int | None = Field(default=None, ge=1)
    return_scores: bool = False


def make_app(
    index: BM25Index,
    *,
    default_topk: int = 3,
    api_key: str | None = None,
    limits: RetrieverLimits | None = None,
):
    """FastAPI app: `POST /retrieve` {queries, topk, return_scores} → {result}; `GET /health`."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    limits = limits or RetrieverLimits()
    app = FastAPI(title="agentrl retriever", description="Search-R1-compatible BM25 retrieval")

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(_validation_message(list(exc.errors())))

    @app.post("/retrieve")
    def retrieve(request: QueryRequest) -> Any:
        # A plain `def` endpoint: FastAPI runs it in its thread pool, off the event loop.
        topk = request.topk or default_topk
        if topk > limits.max_topk:
            return _error(
                f"topk={topk} is over this server's limit of {limits.max_topk}; ask for fewer"
            )
        if len(request.queries) > limits.max_queries:
            return _error(
                f"queries: {len(request.queries)} in one call, over this server's limit of "
                f"{limits.max_queries}; send them in several calls"
            )
        results = index.search(request.queries, topk)
        if request.return_scores:
            return {
                "result": [
                    [{"document": d.to_json(), "score": d.score} for d in docs] for docs in results
                ]
            }
        return {"result": [[d.to_json() for d in docs] for docs in results]}

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "num_documents": len(index.documents)}

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        if api_key and not request.url.path.startswith("/health"):
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.encode(), api_key.encode()
            ):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        if request.method == "POST":
            length = request.headers.get("content-length")
            if length is None or not length.isdigit():  # a chunked body could be any size
                return _error("send a Content-Length header (chunked bodies are refused)", 411)
            if int(length) > limits.max_body_bytes:
                return _error(
                    f"request body is {length} bytes, over this server's limit of "
                    f"{limits.max_body_bytes}; send fewer queries per call",
                    413,
                )
        return await call_next(request)

    return app


def _error(message: str, status_code: int = 400) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"detail": message}, status_code=status_code)  # FastAPI's shape


def _validation_message(errors: list[Any]) -> str:
    """Pydantic's errors -> one line naming each field and the value sent."""
    parts = []
    for e in errors[:3]:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {e.get('msg')} (got {repr(e.get('input'))[:60]})")
    return "invalid request: " + "; ".join(parts)


def make_server(
    corpus: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    topk: int = 3,
    log_level: str = "info",
    api_key: str | None = None,
    limits: RetrieverLimits | None = None,
):
    """A `uvicorn.Server` ready to `.run()`; the index is loaded (or built and cached) first."""
    import uvicorn

    index = BM25Index.load_or_build(corpus)
    app = make_app(index, default_topk=topk, api_key=api_key, limits=limits)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level)
    return uvicorn.Server(config)
