"""`SGLangControl`: `SGLangEngine`'s calls besides generation and weights -- abort and drain,
health, each server's dialect and info, pause/flush, and memory release/resume by tags -- sent
to every worker where the call is per server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

import httpx

from agentrl.engine.base import EngineError
from agentrl.engine.sglang.dialect import ServerDialect, dialect_from_info
from agentrl.engine.sglang.plumbing import SGLangHTTP
from agentrl.engine.sglang.protocol import MEMORY_TAGS, num_requests_from_load


class SGLangControl(SGLangHTTP):
    """A base of `SGLangEngine`, on the HTTP plumbing."""

    # -- abort and drain

    async def _abort_rid(self, rid: str) -> None:
        with contextlib.suppress(EngineError):
            await asyncio.gather(
                *(self._post("/abort_request", {"rid": rid}, url=u) for u in self.worker_urls)
            )

    async def abort(self, *, poll_interval_s: float = 0.5, max_wait_s: float = 60.0) -> None:
        """Drain: refuse new requests, cancel the pending local ones (they return ABORT), then
        `abort_request {abort_all: true}` on every worker until it reports nothing running."""
        self._is_aborting = True
        try:
            for request in list(self._pending):
                request.cancel()
            await asyncio.gather(
                *(self._abort_until_idle(u, poll_interval_s, max_wait_s) for u in self.worker_urls)
            )
        finally:
            self._is_aborting = False

    async def _abort_until_idle(self, url: str, poll_interval_s: float, max_wait_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_wait_s
        while True:
            await self._post("/abort_request", {"abort_all": True}, url=url)
            num_requests = await self.num_requests(url)
            if num_requests <= 0:
                return
            if loop.time() > deadline:
                raise EngineError(
                    f"{url} still runs {num_requests} requests {max_wait_s}s after abort_request"
                )
            await asyncio.sleep(poll_interval_s)

    async def num_requests(self, url: str | None = None) -> int:
        """Running + waiting requests on one server (`/v1/loads`: SGLang since before 0.5.15)."""
        return num_requests_from_load(await self._get("/v1/loads?include=core", url=url))

    # -- health, dialect and info

    async def health(self) -> bool:
        try:
            response = await self._http().get(f"{self.base_url}/health_generate", timeout=30.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def wait_healthy(self, timeout_s: float = 600.0, interval_s: float = 1.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.health():
            if loop.time() > deadline:
                raise EngineError(
                    f"{self.base_url}/health_generate did not answer 200 within {timeout_s}s"
                )
            await asyncio.sleep(interval_s)

    async def dialect(self, url: str | None = None) -> ServerDialect:
        """What one worker (default: the first) speaks, read once from `/server_info` (every
        SGLang of the supported window and `agentrl serve`); refuses an unsupported SGLang."""
        url = url or self.worker_urls[0]
        if url not in self._dialects:
            self._dialects[url] = dialect_from_info(await self._get("/server_info", url=url), url)
        return self._dialects[url]

    async def get_server_info(self, *, url: str | None = None) -> dict[str, Any]:
        """The server info of one worker (default: the first), live state included."""
        url = url or self.worker_urls[0]
        await self.dialect(url)  # refuses an unsupported server
        return await self._get("/server_info", url=url)

    async def get_model_info(self, *, url: str | None = None) -> dict[str, Any]:
        url = url or self.worker_urls[0]
        await self.dialect(url)
        return await self._get("/model_info", url=url)

    async def get_weight_version(self) -> str:
        """The weight version the first worker serves (`weight_version` of its model info)."""
        version = str((await self.get_model_info())["weight_version"])
        self.weight_version = version
        return version

    async def tp_size(self, url: str | None = None) -> int:
        return (await self.dialect(url)).tp_size

    # -- control

    async def flush_cache(self, *, max_wait_s: float = 60.0, poll_interval_s: float = 0.2) -> None:
        """Flush every worker's prefix cache. SGLang answers 400 while requests are running or
        queued (unless paused): retried until `max_wait_s`."""
        await asyncio.gather(
            *(self._flush_one(u, max_wait_s, poll_interval_s) for u in self.worker_urls)
        )

    async def _flush_one(self, url: str, max_wait_s: float, poll_interval_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_wait_s
        while True:
            try:
                await self._post("/flush_cache", url=url)
                return
            except EngineError as e:
                if "HTTP 400" not in str(e):
                    raise
                if loop.time() > deadline:
                    raise EngineError(
                        f"{url}/flush_cache still refused after {max_wait_s}s (requests running "
                        "or queued); pause generation or let them finish before a weight update"
                    ) from None
            await asyncio.sleep(poll_interval_s)

    async def pause_generation(self, mode: str = "abort") -> None:
        """Hold generation on every worker. SGLang's modes: abort (running requests return
        ABORT; its default), retract (running requests go back to the queue and are recomputed
        on the new weights after `continue_generation`), in_place (they stay where they are)."""
        await self._post_workers("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._post_workers("/continue_generation")

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """`/release_memory_occupation` on every worker: tags None = everything; SGLang tags are
        "weights", "kv_cache", "cuda_graph" (they free memory only on a server started with
        --enable-memory-saver)."""
        await self._post_workers("/release_memory_occupation", {"tags": tags})
        for url in self.worker_urls:
            self._released_tags.setdefault(url, set()).update(tags or MEMORY_TAGS)

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """Resume those of `tags` each worker released: SGLang kills a server asked to resume
        memory it never released (as after a colocated `--resume`). tags None: weights first,
        then the KV cache (the peak never holds both next to the trainer's memory)."""
        if tags is None:
            await self.resume_memory(["weights"])
            tags = ["kv_cache", "cuda_graph"]
        due = list(tags)
        await asyncio.gather(*(self._resume_one(u, due) for u in self.worker_urls))

    async def _resume_one(self, url: str, tags: list[str]) -> None:
        released = self._released_tags.get(url, set())
        due = [t for t in tags if t in released]
        if not due:
            return
        await self._post("/resume_memory_occupation", {"tags": due}, url=url)
        released.difference_update(due)

    def released_tags(self, url: str | None = None) -> set[str]:
        """What one worker (default: the first) has released and not resumed."""
        return set(self._released_tags.get(url or self.worker_urls[0], set()))
