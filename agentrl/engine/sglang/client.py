"""`SGLangEngine`: the `Engine` protocol over SGLang's native HTTP API (httpx).

Request and response shapes follow sgl-project/sglang `python/sglang/srt/entrypoints/http_server.py`
and `python/sglang/srt/managers/io_struct.py`; the call pattern follows THUDM/slime
`slime/rollout/sglang_rollout.py` and `slime/backends/sglang_utils/sglang_engine.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import httpx

from agentrl.engine.base import Completion, EngineError, SamplingParams
from agentrl.engine.sglang.dialect import ServerDialect, dialect_from_info
from agentrl.engine.sglang.plumbing import SGLangHTTP
from agentrl.engine.sglang.protocol import (
    MEMORY_TAGS,
    ROUTING_KEY_HEADER,
    aborted_completion,
    completion_from_sglang,
    generate_payload,
    num_requests_from_load,
    version_from_wire,
)
from agentrl.engine.sglang.weights import SGLangWeights

__all__ = ["SGLangEngine"]

if TYPE_CHECKING:
    import torch


class SGLangEngine:
    """An `Engine` backed by one SGLang server, a router over several, or `agentrl serve`.

    Generation goes to `base_url` (a router spreads it; the `routing_key` header keeps an episode
    on one server, so its prefix cache stays warm). Control calls (weights, memory, pause, flush,
    abort) go to `base_url`: a group of servers has a client per server (`RoutedEngine`).

    Retries: connection errors and 500/502/503/504 are retried `max_retries` times with
    exponential backoff; 4xx never (the request is wrong, a retry cannot help). A request that
    exceeds `request_timeout_s`, or fails after its retries, raises `EngineError`.

    Composed of parts: `http` (`SGLangHTTP`: requests, retries, the workers) and `weights`
    (`SGLangWeights`: the weight routes and their session, what the run's weight senders drive).
    `update_weights` sends flattened buckets through `/update_weights_from_tensor` -- same host
    only (CUDA IPC for GPU tensors, shared memory for CPU tensors); across hosts the run
    broadcasts instead (`agentrl.weights.distributed`).

    `api_key` (default: the AGENTRL_API_KEY environment variable) goes with every request as
    `Authorization: Bearer <key>`, as SGLang's and `agentrl serve`'s `--api-key` want it. Each
    server's version is read once from its info route (`dialect`); a release outside the
    supported window is refused there, in one line.
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 256,
        request_timeout_s: float = 600.0,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        api_key: str | None = None,
        failure_report: Callable[[], Awaitable[str | None]] | None = None,
    ) -> None:
        """`failure_report`: what explains a dropped connection (`SGLangHTTP`)."""
        self.http = SGLangHTTP(
            base_url,
            max_connections=max_connections,
            request_timeout_s=request_timeout_s,
            max_retries=max_retries,
            retry_backoff_s=retry_backoff_s,
            api_key=api_key,
            failure_report=failure_report,
        )
        self.base_url = self.http.base_url
        self.weights = SGLangWeights(self)
        self.weight_version = 0  # SGLang's "default": the weights it started with
        self.lora_name: str | None = None  # the LoRA adapter requests name (`weights` loads it)
        self._pending: set[asyncio.Future[Any]] = set()
        self._background: set[asyncio.Future[Any]] = set()
        self._is_aborting = False
        self._dialects: dict[str, ServerDialect] = {}
        self._released_tags: set[str] = set()  # what a resume may map again

    @property
    def worker_urls(self) -> list[str]:
        return self.http.worker_urls

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, weight_version: int
    ) -> None:
        """The `Engine` protocol's update: one bucket (outside a session: a session of its own)."""
        await self.weights.update_weights(list(named_tensors), weight_version=weight_version)

    # -- generation

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, routing_key: str | None = None
    ) -> Completion:
        if not input_ids:
            raise ValueError("generate needs a non-empty input_ids")
        if self._is_aborting:
            return aborted_completion(self.weight_version)
        payload = generate_payload(input_ids, sampling, lora_path=self.lora_name)
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        request = asyncio.ensure_future(
            self.http.request(
                "POST",
                f"{self.base_url}/generate",
                json=payload,
                headers=headers,
                is_fresh_rid=True,
            )
        )
        self._pending.add(request)
        try:
            response = await asyncio.shield(request)
        except asyncio.CancelledError:
            if request.cancelled():  # abort() cancelled it: the episode sees ABORT
                return aborted_completion(self.weight_version)
            # Our caller was cancelled (an episode timeout): free the server's work too.
            request.cancel()
            cleanup = asyncio.ensure_future(self._abort_rid(payload["rid"]))
            self._background.add(cleanup)
            cleanup.add_done_callback(self._background.discard)
            raise
        finally:
            self._pending.discard(request)
        completion = completion_from_sglang(response.json())
        completion.served_by = self.base_url
        self.weight_version = completion.weight_version
        return completion

    # -- the probe before a run

    async def probe(self, timeout_s: float = 10.0) -> str:
        """One GET of the server info (no retries, `timeout_s`): the server's version, or an
        `EngineError` saying in one line what answered -- nothing, an HTTP error, or a body that
        is not an SGLang server's (a router or `agentrl serve` answer as SGLang does)."""
        url = f"{self.base_url}/server_info"
        response = await self._probe_get(url, timeout_s)
        if response.status_code == 404:  # a router may know only the older name
            older = await self._probe_get(f"{self.base_url}/get_server_info", timeout_s)
            if older.status_code != 404:
                url = f"{self.base_url}/get_server_info"
                response = older
        if response.status_code != 200:
            body = " ".join(response.text.split())[:120]
            raise EngineError(f"GET {url} answered HTTP {response.status_code}: {body!r}")
        return self._read_probe(url, response)

    async def _probe_get(self, url: str, timeout_s: float) -> httpx.Response:
        try:
            return await self.http.client().get(url, timeout=timeout_s)
        except httpx.TimeoutException:
            raise EngineError(f"GET {url}: no answer within {timeout_s:g}s") from None
        except httpx.HTTPError as e:
            raise EngineError(f"GET {url}: {_no_connection(e)}") from None

    def _read_probe(self, url: str, response: httpx.Response) -> str:
        try:
            info = response.json()
        except ValueError:
            info = None
        if not isinstance(info, dict) or "version" not in info:
            body = " ".join(response.text.split())[:120]
            raise EngineError(f"GET {url} answered {body!r}, not an SGLang server's info")
        self._dialects[self.base_url] = dialect_from_info(info, self.base_url)  # version check
        return str(info["version"])

    async def close(self) -> None:
        """Closes the connections; the servers stay up (whoever launched them stops them)."""
        await self.http.aclose()

    # -- abort and drain

    async def _abort_rid(self, rid: str) -> None:
        with contextlib.suppress(EngineError):
            await self.http.post("/abort_request", {"rid": rid})

    async def abort(self, *, poll_interval_s: float = 0.5, max_wait_s: float = 60.0) -> None:
        """Drain: refuse new requests, cancel the pending local ones (they return ABORT), then
        `abort_request {abort_all: true}` until the server reports nothing running."""
        self._is_aborting = True
        try:
            for request in list(self._pending):
                request.cancel()
            deadline = asyncio.get_running_loop().time() + max_wait_s
            while True:
                await self.http.post("/abort_request", {"abort_all": True})
                num_requests = await self.num_requests()
                if num_requests <= 0:
                    return
                if asyncio.get_running_loop().time() > deadline:
                    raise EngineError(
                        f"{self.base_url} still runs {num_requests} requests {max_wait_s}s after "
                        "abort_request"
                    )
                await asyncio.sleep(poll_interval_s)
        finally:
            self._is_aborting = False

    async def num_requests(self, url: str | None = None) -> int:
        """Running + waiting requests on one server (`/v1/loads`: SGLang since before 0.5.15)."""
        return num_requests_from_load(await self.http.get("/v1/loads?include=core", url=url))

    # -- health, dialect and info

    async def health(self) -> bool:
        try:
            response = await self.http.client().get(
                f"{self.base_url}/health_generate", timeout=30.0
            )
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def dialect(self, url: str | None = None) -> ServerDialect:
        """What one worker (default: the first) speaks, read once from `/server_info` (every
        SGLang of the supported window and `agentrl serve`); refuses an unsupported SGLang."""
        url = url or self.worker_urls[0]
        if url not in self._dialects:
            self._dialects[url] = dialect_from_info(
                await self.http.get("/server_info", url=url), url
            )
        return self._dialects[url]

    async def get_server_info(self, *, url: str | None = None) -> dict[str, Any]:
        """The server info of one worker (default: the first), live state included."""
        url = url or self.worker_urls[0]
        await self.dialect(url)  # refuses an unsupported server
        return await self.http.get("/server_info", url=url)

    async def get_model_info(self, *, url: str | None = None) -> dict[str, Any]:
        url = url or self.worker_urls[0]
        await self.dialect(url)
        return await self.http.get("/model_info", url=url)

    async def get_weight_version(self) -> int:
        """The weight version the first worker serves (`weight_version` of its model info)."""
        version = version_from_wire((await self.get_model_info())["weight_version"])
        self.weight_version = version
        return version

    async def tp_size(self, url: str | None = None) -> int:
        return (await self.dialect(url)).tp_size

    # -- control

    async def flush_cache(self, *, max_wait_s: float = 60.0, poll_interval_s: float = 0.2) -> None:
        """Flush the server's prefix cache. SGLang answers 400 while requests are running or
        queued (unless paused): retried until `max_wait_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_wait_s
        while True:
            try:
                await self.http.post("/flush_cache")
                return
            except EngineError as e:
                if "HTTP 400" not in str(e):
                    raise
                if loop.time() > deadline:
                    raise EngineError(
                        f"{self.base_url}/flush_cache still refused after {max_wait_s}s (requests running "
                        "or queued); pause generation or let them finish before a weight update"
                    ) from None
            await asyncio.sleep(poll_interval_s)

    async def pause_generation(self, mode: str = "abort") -> None:
        """Hold generation on the server. SGLang's modes: abort (running requests return
        ABORT; its default), retract (running requests go back to the queue and are recomputed
        on the new weights after `continue_generation`), in_place (they stay where they are)."""
        await self.http.post_workers("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self.http.post_workers("/continue_generation")

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """`/release_memory_occupation`: tags None = everything; SGLang tags are
        "weights", "kv_cache", "cuda_graph" (they free memory only on a server started with
        --enable-memory-saver)."""
        await self.http.post_checked("/release_memory_occupation", {"tags": tags})
        self._released_tags.update(tags or MEMORY_TAGS)

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """Resume those of `tags` the server released: SGLang kills a server asked to resume
        memory it never released (as after a colocated `--resume`). tags None: weights first,
        then the KV cache (the peak never holds both next to the trainer's memory)."""
        if tags is None:
            await self.resume_memory(["weights"])
            tags = ["kv_cache", "cuda_graph"]
        due = [t for t in tags if t in self._released_tags]
        if due:
            await self.http.post("/resume_memory_occupation", {"tags": due})
            self._released_tags.difference_update(due)

    def released_tags(self) -> set[str]:
        """What the server has released and not resumed."""
        return set(self._released_tags)


def _no_connection(error: httpx.HTTPError) -> str:
    """What a failed connection met, in words: a refusal, an unknown host, or httpx's own."""
    cause: BaseException | None = error
    while cause is not None:  # httpx wraps httpcore, which wraps anyio's OSError, which wraps...
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused (nothing listens on that port)"
        if isinstance(cause, socket.gaierror):
            return f"unknown host ({cause})"
        cause = cause.__cause__ or cause.__context__
    if isinstance(error, httpx.ConnectError):
        return f"could not connect ({error})"
    return f"{type(error).__name__}: {error}"
