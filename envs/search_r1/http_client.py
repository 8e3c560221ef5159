"""`HTTPRetriever`: a client for any server speaking Search-R1's `POST /retrieve`
(`agentrl retriever serve`, or Search-R1's own `retrieval_server.py`)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

import httpx
import tenacity
from agentrl_envs.search_r1.retrieval import Document, QueryBatcher

START_HINT = (
    "start one with `agentrl retriever serve --corpus CORPUS.jsonl --port {port}` "
    "(or Search-R1's retrieval_server.py), or drop `retriever_url` to use the embedded BM25 retriever"
)


class RetrieverUnavailableError(RuntimeError):
    """The configured retrieval server cannot be reached: an infrastructure failure, never a reward."""


class _ServerError(RuntimeError):
    """A 5xx answer: retried like a connection error."""


class HTTPRetriever:
    """Concurrent searches are gathered for `window_s` into one request (up to
    `max_batch_size` queries); at most `max_concurrency` requests are in flight; each has a
    timeout and is retried with backoff on connection errors, timeouts and 5xx answers;
    answers are kept in an LRU cache."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        max_concurrency: int = 8,
        window_s: float = 0.005,
        max_batch_size: int = 64,
        cache_size: int = 10_000,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        # Sent as `Authorization: Bearer` (`agentrl retriever serve --api-key`); default the
        # environment's AGENTRL_API_KEY, as the server reads it.
        self.api_key = api_key if api_key is not None else os.environ.get("AGENTRL_API_KEY")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.max_concurrency = max_concurrency
        self.batcher = QueryBatcher(
            self._post, window_s=window_s, max_batch_size=max_batch_size, cache_size=cache_size
        )
        self._client: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_reachable = False

    @property
    def endpoint(self) -> str:
        return self.url if self.url.endswith("/retrieve") else f"{self.url}/retrieve"

    async def search(self, queries: Sequence[str], topk: int) -> list[list[Document]]:
        return await self.batcher.search(queries, topk)

    async def check(self) -> None:
        """Raise `RetrieverUnavailableError` (saying how to start a server) if nothing answers;
        after one success it returns at once (later failures surface from `search`)."""
        if self._is_reachable:
            return
        try:
            await self._http().get(
                self.url.removesuffix("/retrieve") + "/", timeout=min(self.timeout_s, 5.0)
            )
        except httpx.TransportError as e:
            raise self._unavailable(e) from None
        self._is_reachable = True

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _http(self) -> httpx.AsyncClient:
        # httpx clients and semaphores belong to one event loop; make new ones on a new loop.
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._loop = loop
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._client = httpx.AsyncClient(
                timeout=self.timeout_s,
                limits=httpx.Limits(max_connections=self.max_concurrency),
                headers=headers,
            )
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        return self._client

    async def _post(self, queries: list[str], topk: int) -> list[list[Document]]:
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(self.max_retries + 1),
            wait=tenacity.wait_exponential(multiplier=0.2, max=5.0),
            retry=tenacity.retry_if_exception_type((httpx.TransportError, _ServerError)),
            reraise=True,
        )
        try:
            return await retrying(self._post_once, queries, topk)
        except (httpx.TransportError, _ServerError) as e:
            raise self._unavailable(e) from None

    async def _post_once(self, queries: list[str], topk: int) -> list[list[Document]]:
        client = self._http()
        assert self._semaphore is not None
        async with self._semaphore:
            response = await client.post(
                self.endpoint, json={"queries": queries, "topk": topk, "return_scores": True}
            )
        if response.status_code >= 500:
            raise _ServerError(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.status_code != 200:
            raise RuntimeError(
                f"retrieval server {self.endpoint} answered HTTP {response.status_code}: {response.text[:300]}"
            )
        return parse_response(response.json(), num_queries=len(queries))

    def _unavailable(self, error: Exception | None) -> RetrieverUnavailableError:
        port = httpx.URL(self.url).port or 8000
        return RetrieverUnavailableError(
            f"retrieval server {self.endpoint} is unreachable after {self.max_retries + 1} tries ({error!r}); "
            + START_HINT.format(port=port)
        )


def parse_response(body: dict[str, Any], *, num_queries: int) -> list[list[Document]]:
    """Read `{"result": [[{"document": {...}, "score": s} | {...}, ...], ...]}`."""
    result = body.get("result")
    if not isinstance(result, list) or len(result) != num_queries:
        raise RuntimeError(
            f"retrieval server answer needs 'result' with {num_queries} lists, got {str(body)[:200]}"
        )
    return [[_document(item) for item in per_query] for per_query in result]


def _document(item: dict[str, Any]) -> Document:
    doc, score = (item["document"], item.get("score")) if "document" in item else (item, None)
    contents = doc.get("contents")
    if contents is None:  # Search-R1's pyserini branch also returns title/text
        contents = f'"{doc.get("title", "")}"\n{doc.get("text", "")}'
    return Document(id=str(doc.get("id", "")), contents=contents, score=score)
