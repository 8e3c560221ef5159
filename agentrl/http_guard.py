"""What an agentrl HTTP server checks before a request reaches its route: the API key, as SGLang
0.5.23 checks it (`sglang/srt/utils/auth.py`: `Authorization: Bearer <key>` on every route but the
health, readiness and metrics probes; admin routes take the admin key when one is set; 401
`{"error": "Unauthorized"}`), and the size of the body (413). Shared by `agentrl serve`,
`agentrl env serve` and the retriever server, so it sits below all of them."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from starlette.responses import JSONResponse

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]

OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # probes carry no secrets (SGLang's rule)


def error_response(message: str, status_code: int = 400) -> JSONResponse:
    """SGLang's http_server.py `_create_error_response` / ErrorResponse shape."""
    kind = HTTPStatus(status_code).phrase  # "Bad Request", "Insufficient Storage", ...
    return JSONResponse(
        {"object": "error", "message": message, "type": kind, "param": None, "code": status_code},
        status_code=status_code,
    )


def _bearer_matches(header: str | None, key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def is_allowed(
    method: str,
    path: str,
    authorization: str | None,
    *,
    api_key: str | None,
    admin_api_key: str | None,
    is_admin_route: bool,
) -> bool:
    """SGLang's `decide_request_auth` for its normal and admin-optional levels."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    if is_admin_route and admin_api_key:
        return _bearer_matches(authorization, admin_api_key)
    if api_key:
        return _bearer_matches(authorization, api_key)
    return True


class GuardMiddleware:
    """ASGI (not `BaseHTTPMiddleware`, which hides client disconnects from the routes): refuse an
    unauthorized request (401) before its body is read, then a body over `max_body_bytes` (413),
    by its Content-Length or, when chunked, as it arrives."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        admin_paths: frozenset[str],
        api_key: str | None,
        admin_api_key: str | None,
        max_body_bytes: int,
    ) -> None:
        self.app = app
        self.admin_paths = admin_paths
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        allowed = is_allowed(
            scope["method"],
            scope["path"],
            headers.get("authorization"),
            api_key=self.api_key,
            admin_api_key=self.admin_api_key,
            is_admin_route=scope["path"] in self.admin_paths,
        )
        if not allowed:
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(int(length))(scope, receive, send)
            return
        if length is None and headers.get("transfer-encoding", "").lower() == "chunked":
            body = await self._read_chunked(receive)
            if body is None:
                await self._too_large(None)(scope, receive, send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def _read_chunked(self, receive: Any) -> bytes | None:
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, length: int | None) -> JSONResponse:
        got = f"{length} bytes" if length is not None else "more"
        return error_response(
            f"request body is {got}, over this server's limit of {self.max_body_bytes} bytes; "
            "send less, or raise the server's --max-body-mb",
            status_code=413,
        )


def _replay(body: bytes, receive: Any) -> Any:
    """A `receive` that yields the already-read body once, then the client's next messages."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replayed
