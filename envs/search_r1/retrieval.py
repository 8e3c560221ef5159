"""Retrieval: the `Retriever` protocol, documents, and the micro-batcher and LRU cache that
both the in-process BM25 retriever and the HTTP client put in front of their backends."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Document:
    """One corpus row in Search-R1 format: `contents` = '"Title"\\ntext'."""

    id: str
    contents: str
    score: float | None = None

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0].strip('"')

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "contents": self.contents}


@runtime_checkable
class Retriever(Protocol):
    """Anything that answers a batch of queries with the top-k documents of each."""

    async def search(self, queries: Sequence[str], topk: int) -> list[list[Document]]: ...

    async def close(self) -> None: ...


BatchFn = Callable[[list[str], int], Awaitable[list[list[Document]]]]


class QueryBatcher:
    """Gathers queries from concurrent callers for up to `window_s` (or `max_batch_size`
    queries) and answers them with one backend call per top-k, so many episodes searching
    at once cost one request; an LRU cache answers repeated queries without a call."""

    def __init__(
        self,
        backend: BatchFn,
        *,
        window_s: float = 0.005,
        max_batch_size: int = 64,
        cache_size: int = 10_000,
    ) -> None:
        self.backend = backend
        self.window_s = window_s
        self.max_batch_size = max_batch_size
        self.cache: LRUCache[tuple[str, int], list[Document]] = LRUCache(cache_size)
        # Keyed by (event loop, topk): a future is only ever batched with its own loop's.
        self._pending: dict[tuple[int, int], list[tuple[str, asyncio.Future[list[Document]]]]] = {}
        self._flushers: dict[tuple[int, int], asyncio.TimerHandle] = {}
        self.num_backend_calls = 0

    async def search(self, queries: Sequence[str], topk: int) -> list[list[Document]]:
        return list(await asyncio.gather(*(self.search_one(q, topk) for q in queries)))

    async def search_one(self, query: str, topk: int) -> list[Document]:
        cached = self.cache.get((query, topk))
        if cached is not None:
            return cached
        loop = asyncio.get_running_loop()
        key = (id(loop), topk)
        future: asyncio.Future[list[Document]] = loop.create_future()
        pending = self._pending.setdefault(key, [])
        pending.append((query, future))
        if len(pending) >= self.max_batch_size:
            self._flush(key)
        elif key not in self._flushers:
            self._flushers[key] = loop.call_later(self.window_s, self._flush, key)
        return await future

    def _flush(self, key: tuple[int, int]) -> None:
        handle = self._flushers.pop(key, None)
        if handle is not None:
            handle.cancel()
        batch = self._pending.pop(key, [])
        if batch:
            asyncio.get_running_loop().create_task(self._answer(batch, key[1]))

    async def _answer(
        self, batch: list[tuple[str, asyncio.Future[list[Document]]]], topk: int
    ) -> None:
        unique = list(dict.fromkeys(q for q, _ in batch))
        self.num_backend_calls += 1
        try:
            results = dict(zip(unique, await self.backend(unique, topk), strict=True))
        except BaseException as e:  # every waiter gets the error, none hangs
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return
        for query, docs in results.items():
            self.cache.put((query, topk), docs)
        for query, future in batch:
            if not future.done():
                future.set_result(results[query])


class LRUCache(collections.OrderedDict):
    """A bounded mapping that forgets the least recently used key first."""

    def __init__(self, max_size: int) -> None:
        super().__init__()
        self.max_size = max_size

    def get(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            return default
        self.move_to_end(key)
        return self[key]

    def put(self, key: Any, value: Any) -> None:
        if self.max_size <= 0:
            return
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.max_size:
            self.popitem(last=False)
