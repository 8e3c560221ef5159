"""`AgentEndpoint`: the loopback OpenAI-compatible server agents talk to during rollouts.

Each episode gets its own base URL (`http://127.0.0.1:PORT/episodes/TOKEN/v1`, TOKEN a random
secret), so an unmodified `openai.AsyncOpenAI` client is bound to one episode's capture
(`/chat/completions`; Anthropic's `/messages` shape too). The
HTTP server runs in its own thread and event loop (uvicorn's signal handling and the run's
loop stay apart); each call is handed to the run's loop, where the engine and captures live."""

from __future__ import annotations

import asyncio
import secrets
import threading
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from agentrl.engine.base import Engine, SamplingParams
from agentrl.engine.serve.openai import chat_chunks, streamed
from agentrl.rollout.agent_endpoint.anthropic import (
    MessagesRequest,
    to_chat_request,
    to_messages_response,
)
from agentrl.rollout.agent_endpoint.capture import EpisodeCapture
from agentrl.rollout.agent_endpoint.chat import CallLimits, ChatError, ChatRequest, complete


@dataclass
class _Episode:
    capture: EpisodeCapture
    sampling: SamplingParams
    limits: CallLimits


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


class AgentEndpoint:
    """One server for every episode of a runner; `open` binds a base URL to an episode."""

    def __init__(self, engine: Engine, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = engine
        self.host = host
        self.port = port
        self._episodes: dict[str, _Episode] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._started: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Start serving (once, however many episodes ask at the same time); the calling loop
        is the one calls are run on."""
        started = self._started
        if started is not None and started.done() and started.exception() is None:
            self._loop = asyncio.get_running_loop()  # serving: calls go to whichever loop asks
            return
        if started is None or started.done():
            self._started = started = asyncio.ensure_future(self._start())
        await asyncio.shield(started)

    async def _start(self) -> None:
        import uvicorn

        self._loop = asyncio.get_running_loop()
        config = uvicorn.Config(
            self._app(), host=self.host, port=self.port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, name="agentrl-agent-endpoint", daemon=True
        )
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"agent endpoint could not listen on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        self._thread = None
        self._started = None

    def open(self, capture: EpisodeCapture, sampling: SamplingParams, limits: CallLimits) -> str:
        """A base URL whose calls are recorded by `capture`; its token is also the API key."""
        token = secrets.token_urlsafe(16)
        self._episodes[token] = _Episode(capture, sampling, limits)
        return f"http://{self.host}:{self.port}/episodes/{token}/v1"

    def close(self, base_url: str) -> None:
        """Stop answering for this episode (a late call from a leaked client gets 404)."""
        self._episodes.pop(base_url.rstrip("/").split("/")[-2], None)

    # ---------------------------------------------------------------- the app

    def _app(self) -> FastAPI:
        app = FastAPI(title="agentrl agent endpoint")

        @app.exception_handler(RequestValidationError)
        async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0] if exc.errors() else {}
            where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "body"
            return _error(400, f"{where}: {first.get('msg', 'invalid request')}")

        @app.get("/episodes/{token}/v1/models")
        async def models(token: str) -> Any:
            if token not in self._episodes:
                return _error(404, "no episode has this URL (it ended)")
            card = {"id": "agentrl-policy", "object": "model", "owned_by": "agentrl"}
            return {"object": "list", "data": [card]}

        @app.post("/episodes/{token}/v1/chat/completions")
        async def chat(token: str, body: ChatRequest) -> Any:
            episode = self._episodes.get(token)
            if episode is None:
                return _error(404, "no episode has this URL (it ended)")
            try:
                response = await self._on_run_loop(episode, body)
            except ChatError as e:
                return _error(e.status, str(e))
            if body.stream:
                return streamed(response, chat_chunks)
            return response

        @app.post("/episodes/{token}/v1/messages")
        async def messages(token: str, body: MessagesRequest) -> Any:
            episode = self._episodes.get(token)
            if episode is None:
                return _error(404, "no episode has this URL (it ended)")
            if body.stream:
                return _error(400, "stream: the Messages route answers whole; pass stream=false")
            try:
                request = to_chat_request(body)
            except ValueError as e:  # a malformed Messages body: the agent's to fix, not a 500
                return _error(400, str(e).splitlines()[0])
            try:
                response = await self._on_run_loop(episode, request)
            except ChatError as e:
                return _error(e.status, str(e))
            return to_messages_response(response, body.model)

        return app

    async def _on_run_loop(self, episode: _Episode, body: ChatRequest) -> dict[str, Any]:
        assert self._loop is not None
        call = complete(episode.capture, self.engine, episode.sampling, episode.limits, body)
        future = asyncio.run_coroutine_threadsafe(call, self._loop)
        return await asyncio.wrap_future(future)  # a cancelled request cancels its sampling
