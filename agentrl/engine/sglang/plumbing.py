"""`SGLangHTTP`: the HTTP plumbing `SGLangEngine` and its weights part hold -- one httpx client per
event loop, the API key, retries with backoff (connection errors and 5xx; never 4xx, never the
collective routes), SGLang's error bodies as one-line `EngineError`s, and calls sent to every
worker."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import httpx
import tenacity

from agentrl.engine.base import EngineError, EngineMemoryError, EngineUnavailable
from agentrl.engine.sglang.protocol import API_KEY_ENV

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


class SGLangHTTP:
    """Requests to `base_url`, retried as the class docstring of `SGLangEngine` says.
    `failure_report`: what explains a request that never got through (a launched server that
    died, with its last log lines), quoted in its error."""

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
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"SGLangEngine base_url={base_url!r} must start with http:// or https://"
            )
        self.base_url = base_url.rstrip("/")
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.failure_report = failure_report
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    @property
    def worker_urls(self) -> list[str]:
        return [self.base_url]

    def client(self) -> httpx.AsyncClient:
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

    async def request(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        headers: dict[str, str] | None = None,
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
            return await retrying(self._attempt, method, url, json, headers, is_fresh_rid)
        except _Retryable as e:
            error_cls = EngineUnavailable if e.is_unreachable else EngineError
            # a launched server that died explains the connection errors: say so, with its logs
            report = await self.failure_report() if self.failure_report is not None else None
            raise error_cls(
                f"{method} {url} failed after {attempts} attempt{'s' * (attempts > 1)}; "
                f"last error: {e}" + (f"\n{report}" if report else "")
            ) from None

    async def _attempt(
        self,
        method: str,
        url: str,
        json: Any,
        headers: dict[str, str] | None,
        is_fresh_rid: bool,
    ) -> httpx.Response:
        if is_fresh_rid:
            json["rid"] = uuid.uuid4().hex  # the caller's dict: a cancel aborts the live rid
        try:
            response = await self.client().request(method, url, json=json, headers=headers)
        except _UNREACHABLE as e:
            raise _Retryable(f"{type(e).__name__}: {e}", is_unreachable=True) from e
        except httpx.TimeoutException as e:
            raise EngineError(
                f"{method} {url} timed out after {self.request_timeout_s}s ({type(e).__name__}); "
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

    async def aclose(self) -> None:
        if self._client is not None:
            with contextlib.suppress(RuntimeError):  # its loop may be gone already
                await self._client.aclose()
            self._client = None

    async def post(
        self, path: str, payload: dict[str, Any] | None = None, *, url: str | None = None
    ) -> Any:
        response = await self.request("POST", f"{url or self.base_url}{path}", json=payload or {})
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    async def get(self, path: str, *, url: str | None = None) -> Any:
        response = await self.request("GET", f"{url or self.base_url}{path}")
        return response.json() if response.content else None

    async def post_checked(
        self, path: str, payload: dict[str, Any] | None = None, *, url: str | None = None
    ) -> Any:
        """`post` to one server, its `{"success": false, "message"}` answer raised."""
        return _checked(url or self.base_url, path, await self.post(path, payload, url=url))

    async def post_workers(self, path: str, payload: dict[str, Any] | None = None) -> list[Any]:
        """`post` to every worker; any `success: false` among the answers is raised."""
        urls = self.worker_urls
        results = await asyncio.gather(*(self.post(path, payload, url=u) for u in urls))
        return [_checked(url, path, result) for url, result in zip(urls, results, strict=True)]


def _checked(url: str, path: str, result: Any) -> Any:
    if isinstance(result, dict) and result.get("success") is False:
        raise EngineError(f"POST {url}{path} failed: {result.get('message')}")
    return result
