"""The retrieval server behind `agentrl retriever serve`: Search-R1's `POST /retrieve` API over
one BM25 index, so several rollout workers share it."""

from __future__ import annotations

from pathlib import Path

from agentrl_envs.search_r1.bm25 import BM25Index
from pydantic import BaseModel


class QueryRequest(BaseModel):
    """Search-R1's request body (module level: FastAPI resolves the annotations here)."""

    queries: list[str]
    topk: int | None = None
    return_scores: bool = False


def make_app(index: BM25Index, *, default_topk: int = 3):
    """FastAPI app: `POST /retrieve` {queries, topk, return_scores} → {result}; `GET /health`."""
    from fastapi import FastAPI

    app = FastAPI(title="agentrl retriever", description="Search-R1-compatible BM25 retrieval")

    @app.post("/retrieve")
    def retrieve(request: QueryRequest) -> dict:
        # A plain `def` endpoint: FastAPI runs it in its thread pool, off the event loop.
        results = index.search(request.queries, request.topk or default_topk)
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

    return app


def make_server(
    corpus: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    topk: int = 3,
    log_level: str = "info",
):
    """A `uvicorn.Server` ready to `.run()`; the index is loaded (or built and cached) first."""
    import uvicorn

    index = BM25Index.load_or_build(corpus)
    config = uvicorn.Config(
        make_app(index, default_topk=topk), host=host, port=port, log_level=log_level
    )
    return uvicorn.Server(config)
