"""`SGLangEngine`: the `Engine` protocol over SGLang's native HTTP API (httpx).

Request and response shapes follow sgl-project/sglang `python/sglang/srt/entrypoints/http_server.py`
and `python/sglang/srt/managers/io_struct.py`; the call pattern follows THUDM/slime
`slime/rollout/sglang_rollout.py` and `slime/backends/sglang_utils/sglang_engine.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import httpx

from agentrl.engine.base import Completion, EngineError, SamplingParams
from agentrl.engine.sglang.dialect import dialect_from_info
from agentrl.engine.sglang.protocol import (
    ROUTING_KEY_HEADER,
    aborted_completion,
    completion_from_sglang,
    generate_payload,
)
from agentrl.engine.sglang.weight_control import SGLangWeights

__all__ = ["SGLangEngine"]


class SGLangEngine(SGLangWeights):
    """An `Engine` backed by one SGLang server, a router over several, or `agentrl serve`.

    Generation goes to `base_url` (a router spreads it; the `routing_key` header keeps an episode
    on one server, so its prefix cache stays warm). Control calls (weights, memory, pause, flush,
    abort) go to every worker: `cluster.worker_urls` when launched by agentrl, else `base_url`.

    Retries: connection errors and 500/502/503/504 are retried `max_retries` times with
    exponential backoff; 4xx never (the request is wrong, a retry cannot help). A request that
    exceeds `request_timeout_s`, or fails after its retries, raises `EngineError`.

    `update_weights` sends flattened buckets through `/update_weights_from_tensor` -- same host
    only (CUDA IPC for GPU tensors, shared memory for CPU tensors), one flattened bucket per dtype
    of what it is given (the trainer's exporter already cut the weights into buckets). Across
    hosts the run broadcasts instead (`weight_sender.DistributedWeightSender`).

    `api_key` (default: the AGENTRL_API_KEY environment variable) goes with every request as
    `Authorization: Bearer <key>`, as SGLang's and `agentrl serve`'s `--api-key` want it. Each
    server's version is read once from its info route (`dialect`); a release outside the
    supported window is refused there, in one line.
    """

    # -- generation

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, routing_key: str | None = None
    ) -> Completion:
        if not input_ids:
            raise ValueError("generate needs a non-empty input_ids")
        if self._is_aborting:
            return aborted_completion(self.weight_version)
        payload = generate_payload(input_ids, sampling)
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        request = asyncio.ensure_future(
            self._request(
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
                url, response = f"{self.base_url}/get_server_info", older
        if response.status_code != 200:
            body = " ".join(response.text.split())[:120]
            raise EngineError(f"GET {url} answered HTTP {response.status_code}: {body!r}")
        return self._read_probe(url, response)

    async def _probe_get(self, url: str, timeout_s: float) -> httpx.Response:
        try:
            return await self._http().get(url, timeout=timeout_s)
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

    async def heal(self) -> list[int]:
        """Restart the servers agentrl launched that died (`SGLangCluster.heal`): their indices."""
        return await self.cluster.heal() if self.cluster is not None else []

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(RuntimeError):  # its loop may be gone already
                await self._client.aclose()
            self._client = None
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


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
