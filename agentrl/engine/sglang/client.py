"""`SGLangEngine`: the `Engine` protocol over SGLang's native HTTP API (httpx).

Request and response shapes follow sgl-project/sglang `python/sglang/srt/entrypoints/http_server.py`
and `python/sglang/srt/managers/io_struct.py`; the call pattern follows THUDM/slime
`slime/rollout/sglang_rollout.py` and `slime/backends/sglang_utils/sglang_engine.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Literal

import httpx
import tenacity

from agentrl.engine.base import (
    Completion,
    EngineError,
    EngineMemoryError,
    EngineUnavailable,
    SamplingParams,
)
from agentrl.engine.sglang.control import SGLangControl
from agentrl.engine.sglang.protocol import (
    API_KEY_ENV,
    DEFAULT_WEIGHT_VERSION,
    ROUTING_KEY_HEADER,
    aborted_completion,
    completion_from_sglang,
    generate_payload,
)
from agentrl.engine.sglang.weight_control import SGLangWeights

if TYPE_CHECKING:
    from agentrl.engine.sglang.dialect import ServerDialect
    from agentrl.engine.sglang.launcher import SGLangCluster
    from agentrl.engine.sglang.weight_sender import DistributedWeightSender

__all__ = ["SGLangEngine"]

logger = logging.getLogger(__name__)

_RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
# Routes whose server side joins a collective (a rendezvous, a broadcast receive): a second
# attempt would wait for a trainer that already moved on, until the group's timeout.
_COLLECTIVE_ROUTES = ("/init_weights_update_group", "/update_weights_from_distributed")


def _error_message(response: httpx.Response) -> str:
    """The message of an error body (SGLang's `{"error": {"message"}}`, `{"error": text}` or
    `{"message"}`), else the body itself."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(error)[:500]


_UNREACHABLE = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
)


class _Retryable(Exception):
    """A connection error or a 5xx: worth another attempt after a backoff."""

    def __init__(self, error: str, *, is_unreachable: bool = False) -> None:
        super().__init__(error)
        self.is_unreachable = is_unreachable


# ---------------------------------------------------------------- the client


class SGLangEngine(SGLangControl, SGLangWeights):
    """An `Engine` backed by one SGLang server, a router over several, or `agentrl serve`.

    Generation goes to `base_url` (a router spreads it; the `routing_key` header keeps an episode
    on one server, so its prefix cache stays warm). Control calls (weights, memory, pause, flush,
    abort) go to every worker: `cluster.worker_urls` when launched by agentrl, else `base_url`.

    Retries: connection errors and 500/502/503/504 are retried `max_retries` times with
    exponential backoff; 4xx never (the request is wrong, a retry cannot help). A request that
    exceeds `request_timeout_s`, or fails after its retries, raises `EngineError`.

    `update_weights` path: "tensor" (default) sends flattened buckets through
    `/update_weights_from_tensor` -- same host only (CUDA IPC for GPU tensors, shared memory for
    CPU tensors), one flattened bucket per dtype of what it is given (the trainer's exporter
    already cut the weights into buckets); "distributed" broadcasts over a torch.distributed group (gloo on CPU, NCCL on
    GPU) and works across hosts.

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
        weight_update_path: Literal["tensor", "distributed"] = "tensor",
        worker_urls: list[str] | None = None,
        api_key: str | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"SGLangEngine base_url={base_url!r} must start with http:// or https://"
            )
        if max_connections < 1 or max_retries < 0 or request_timeout_s <= 0:
            raise ValueError(
                f"SGLangEngine needs max_connections >= 1, max_retries >= 0, request_timeout_s > 0; got "
                f"{max_connections}, {max_retries}, {request_timeout_s}"
            )
        if weight_update_path not in ("tensor", "distributed"):
            raise ValueError(
                f"weight_update_path={weight_update_path!r}; use 'tensor' or 'distributed'"
            )
        self.base_url = base_url.rstrip("/")
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.weight_update_path = weight_update_path
        self._worker_urls = list(worker_urls) if worker_urls else None
        self.cluster: SGLangCluster | None = None  # set by make_engine for launched servers
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._pending: set[asyncio.Future[Any]] = set()
        self._background: set[asyncio.Future[Any]] = set()
        self._is_aborting = False
        self._weight_version = DEFAULT_WEIGHT_VERSION
        self._tp_size: int | None = None
        self._sender: DistributedWeightSender | None = None
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self._dialects: dict[str, ServerDialect] = {}
        self._released_tags: dict[str, set[str]] = {}  # per worker: what a resume may map again
        self._is_updating = False  # inside a weight-update session opened by the caller

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def worker_urls(self) -> list[str]:
        if self._worker_urls is not None:  # servers behind a router this client did not launch
            return list(self._worker_urls)
        return list(self.cluster.worker_urls) if self.cluster is not None else [self.base_url]

    # -- HTTP plumbing

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:  # a client is bound to one loop
            limits = httpx.Limits(
                max_connections=self.max_connections, max_keepalive_connections=self.max_connections
            )
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.request_timeout_s), limits=limits, headers=headers
            )
            self._client_loop = loop
        return self._client

    async def _request(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
        is_fresh_rid: bool = False,
    ) -> httpx.Response:
        """`is_fresh_rid`: every attempt sends `json` under a new `rid` (SGLang refuses a second
        request with the `rid` of one still live, as a timed-out first attempt may be)."""
        attempts = 1 if url.endswith(_COLLECTIVE_ROUTES) else self.max_retries + 1
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(attempts),
            wait=tenacity.wait_exponential(multiplier=self.retry_backoff_s)
            + tenacity.wait_random(0, 0.1 * self.retry_backoff_s),
            retry=tenacity.retry_if_exception_type(_Retryable),
            reraise=True,
        )
        try:
            return await retrying(
                self._attempt,
                method,
                url,
                json,
                headers,
                timeout_s or self.request_timeout_s,
                is_fresh_rid,
            )
        except _Retryable as e:
            error_cls = EngineUnavailable if e.is_unreachable else EngineError
            raise error_cls(
                f"{method} {url} failed after {attempts} attempt{'s' * (attempts > 1)}; "
                f"last error: {e}" + self._cluster_note()
            ) from None

    async def _attempt(
        self,
        method: str,
        url: str,
        json: Any,
        headers: dict[str, str] | None,
        timeout_s: float,
        is_fresh_rid: bool,
    ) -> httpx.Response:
        if is_fresh_rid:
            json["rid"] = uuid.uuid4().hex  # the caller's dict: a cancel aborts the live rid
        try:
            response = await self._http().request(
                method, url, json=json, headers=headers, timeout=httpx.Timeout(timeout_s)
            )
        except _UNREACHABLE as e:
            raise _Retryable(f"{type(e).__name__}: {e}", is_unreachable=True) from e
        except httpx.TimeoutException as e:
            raise EngineError(
                f"{method} {url} timed out after {timeout_s}s ({type(e).__name__}); "
                "raise engine.request_timeout_s if generations are legitimately this long"
            ) from e
        if response.status_code == HTTPStatus.INSUFFICIENT_STORAGE:  # agentrl serve: no room
            raise EngineMemoryError(_error_message(response))
        if response.status_code in _RETRYABLE_STATUS:
            raise _Retryable(f"HTTP {response.status_code}: {response.text[:300]}")
        if response.status_code >= 400:
            raise EngineError(
                f"{method} {url} -> HTTP {response.status_code} (not retried): "
                f"{_error_message(response)}"
            )
        return response

    def _cluster_note(self) -> str:
        """A launched server that died explains the connection errors: say so, with its logs."""
        report = self.cluster.failure_report() if self.cluster is not None else None
        return f"\n{report}" if report else ""

    async def _post(
        self,
        path: str,
        payload: dict[str, Any] | None = None,
        *,
        url: str | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        response = await self._request(
            "POST", f"{url or self.base_url}{path}", json=payload or {}, timeout_s=timeout_s
        )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    async def _get(
        self, path: str, *, url: str | None = None, timeout_s: float | None = None
    ) -> Any:
        response = await self._request("GET", f"{url or self.base_url}{path}", timeout_s=timeout_s)
        return response.json() if response.content else None

    async def _post_workers(self, path: str, payload: dict[str, Any] | None = None) -> list[Any]:
        results = await asyncio.gather(
            *(self._post(path, payload, url=u) for u in self.worker_urls)
        )
        for url, result in zip(self.worker_urls, results, strict=False):
            if isinstance(result, dict) and result.get("success") is False:
                raise EngineError(f"POST {url}{path} failed: {result.get('message')}")
        return list(results)

    # -- generation

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, routing_key: str | None = None
    ) -> Completion:
        if not input_ids:
            raise ValueError("generate needs a non-empty input_ids")
        if self._is_aborting:
            return aborted_completion(self._weight_version)
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
                return aborted_completion(self._weight_version)
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
        self._weight_version = completion.weight_version
        return completion

    async def close(self) -> None:
        if self._sender is not None:
            await self._sender.close()
            self._sender = None
        if self._client is not None:
            with contextlib.suppress(RuntimeError):  # its loop may be gone already
                await self._client.aclose()
            self._client = None
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
