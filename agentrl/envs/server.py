"""`agentrl env serve`: any `AgentEnv` over HTTP, one session (env instance) per episode.

Routes: `GET /info` (tool-call format, stop strings, limits), `GET /tasks?split=`,
`POST /sessions` (reset), `POST /sessions/{id}/step`, `DELETE /sessions/{id}` (close),
`GET /health`. Each session's env runs on a thread of its own, so a slow or stuck step never
stalls the server; a step past `step_timeout_s` ends its session (504). At most `max_sessions`
live at once and `max_sessions_per_client` per client address (429 beyond); a session idle
for `session_ttl_s` is closed and forgotten (an abandoned client never leaks an env). With an
`api_key`, every route but `/health` wants `Authorization: Bearer KEY` (401 before the body is
read); a body over `max_body_bytes` is a 413."""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.http_guard import GuardMiddleware
from agentrl.types import Message, Task

T = TypeVar("T")


class TaskBody(BaseModel):
    id: str
    data: dict[str, Any]
    split: str = "train"


class ResetBody(BaseModel):
    task: TaskBody
    seed: int | None = None


class FunctionBody(BaseModel):
    name: str = ""
    arguments: str | dict[str, Any] = ""


class ToolCallBody(BaseModel):
    id: str = ""
    type: str = "function"
    function: FunctionBody


class ActionBody(BaseModel):
    """An assistant message as `Message.to_dict` writes it."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["assistant"]
    content: str | None = ""
    tool_calls: list[ToolCallBody] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class StepBody(BaseModel):
    action: ActionBody


class SessionThread:
    """A thread running an event loop of its own, where one session's env lives: its reset, steps
    and close (the loop the env's own objects bind to). A step that outlives its time limit
    keeps this thread, not the server's loop, until it returns."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True, name="agentrl-env-session")
        self.thread.start()

    def _run(self) -> None:
        self.loop.run_forever()
        self.loop.close()

    async def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """`coro`'s result; `asyncio.TimeoutError` past `timeout_s` (the coroutine is cancelled
        at its next await; code that never awaits runs on, on this thread)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)

    def close_env(self, env: AgentEnv) -> None:
        """Close `env` on this thread once it is free, then end the thread."""

        async def close_then_stop() -> None:
            try:
                await env.close()
            except Exception:  # the episode is over either way; the server keeps serving
                traceback.print_exc()
            finally:
                self.loop.call_soon(self.loop.stop)

        asyncio.run_coroutine_threadsafe(close_then_stop(), self.loop)

    @property
    def is_alive(self) -> bool:
        return self.thread.is_alive()


@dataclass
class _Session:
    env: AgentEnv
    client: str
    last_used: float
    runner: SessionThread = field(default_factory=SessionThread)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ended: str | None = None  # why no step may follow: "terminated" or "truncated"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status)


def _jsonable(value: Any) -> Any:
    """Env infos may hold numpy numbers or paths: anything JSON cannot write becomes text."""
    return json.loads(json.dumps(value, default=str))


def _check_positive(flag: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):  # NaN fails every comparison: refuse it here
        raise ValueError(f"{flag}={value}: use a finite number of seconds > 0, e.g. {flag} 600")


class SessionStore:
    """Live sessions, bounded in number (in all and per client), each closed once idle past
    `ttl_s` (`clock` injectable)."""

    def __init__(
        self,
        env_factory: Callable[[], AgentEnv],
        *,
        max_sessions: int,
        ttl_s: float,
        max_sessions_per_client: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        per_client = max_sessions if max_sessions_per_client is None else max_sessions_per_client
        if max_sessions < 1:
            raise ValueError(f"--max-sessions={max_sessions}: use an int >= 1")
        if not 1 <= per_client <= max_sessions:
            raise ValueError(
                f"--max-sessions-per-client={per_client}: use an int in [1, --max-sessions="
                f"{max_sessions}]"
            )
        _check_positive("--session-ttl-s", ttl_s)
        self.env_factory = env_factory
        self.clock = clock
        self.max_sessions, self.max_sessions_per_client, self.ttl_s = (
            max_sessions,
            per_client,
            ttl_s,
        )
        self.sessions: dict[str, _Session] = {}
        self.draining: list[SessionThread] = []  # ended sessions whose step still runs

    def num_held(self) -> int:
        """Live sessions plus ended ones whose thread a stuck step still holds."""
        self.draining = [t for t in self.draining if t.is_alive]
        return len(self.sessions) + len(self.draining)

    async def expire(self) -> list[str]:
        """Close every session idle past the TTL; their ids."""
        now = self.clock()
        stale = [
            sid
            for sid, s in self.sessions.items()
            if now - s.last_used > self.ttl_s and not s.lock.locked()  # mid-step is not idle
        ]
        for sid in stale:
            self.close(sid)
        return stale

    async def open(self, client: str) -> tuple[str, _Session] | str:
        """A new session of `client`, or why not (the message of a 429)."""
        await self.expire()
        if self.num_held() >= self.max_sessions:
            return f"{self.max_sessions} sessions are live (--max-sessions); retry"
        held = sum(s.client == client for s in self.sessions.values())
        if held >= self.max_sessions_per_client:
            return (
                f"client {client} holds {held} sessions (--max-sessions-per-client); close one "
                "(DELETE /sessions/ID) or retry"
            )
        sid = secrets.token_urlsafe(12)
        session = _Session(self.env_factory(), client, self.clock())
        self.sessions[sid] = session
        return sid, session

    def get(self, sid: str) -> _Session | None:
        session = self.sessions.get(sid)
        if session is not None:
            session.last_used = self.clock()
        return session

    def close(self, sid: str) -> bool:
        """Forget the session; its env closes on its own thread once no step runs there."""
        session = self.sessions.pop(sid, None)
        if session is None:
            return False
        session.runner.close_env(session.env)
        if session.lock.locked():  # a step still holds its thread: it counts until it returns
            self.draining.append(session.runner)
        return True


def _step_reply(result: StepResult) -> dict[str, Any]:
    return {
        "observation": [m.to_dict() for m in result.observation],
        "reward": float(result.reward),
        "terminated": bool(result.terminated),
        "truncated": bool(result.truncated),
        "info": _jsonable(result.info or {}),
    }


def create_env_app(
    env_factory: Callable[[], AgentEnv],
    env_cls: type[AgentEnv],
    *,
    env_kwargs: dict[str, Any] | None = None,
    max_sessions: int = 128,
    max_sessions_per_client: int | None = None,
    session_ttl_s: float = 600.0,
    step_timeout_s: float = 300.0,
    api_key: str | None = None,
    max_body_bytes: int = 16 * 2**20,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """The app serving envs made by `env_factory` (instances of `env_cls`);
    `max_sessions_per_client` defaults to `max_sessions`."""
    store = SessionStore(
        env_factory,
        max_sessions=max_sessions,
        max_sessions_per_client=max_sessions_per_client,
        ttl_s=session_ttl_s,
        clock=clock,
    )
    _check_positive("--step-timeout-s", step_timeout_s)
    app = FastAPI(title=f"agentrl env serve: {env_cls.__name__}")
    app.state.sessions = store
    app.add_middleware(
        GuardMiddleware,
        admin_paths=frozenset(),
        api_key=api_key or None,
        admin_api_key=None,
        max_body_bytes=max_body_bytes,
    )

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "body"
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        await store.expire()
        return {"ok": True, "num_sessions": len(store.sessions)}

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return {
            "env": f"{env_cls.__module__}:{env_cls.__qualname__}",
            "tool_call_format": env_cls.tool_call_format,
            "stop": list(env_cls.stop),
            "max_observation_tokens": env_cls.max_observation_tokens,
            "reward_range": list(env_cls.reward_range),
            "max_sessions": store.max_sessions,
            "max_sessions_per_client": store.max_sessions_per_client,
            "session_ttl_s": store.ttl_s,
            "step_timeout_s": step_timeout_s,
        }

    @app.get("/tasks")
    async def tasks(split: str = "train") -> Any:
        try:
            found = await asyncio.to_thread(env_cls.load_tasks, split, **(env_kwargs or {}))
        except (NotImplementedError, TypeError, ValueError) as e:
            return _error(400, f"split={split!r}: {e}")
        return [t.to_dict() for t in found]

    @app.post("/sessions")
    async def reset(body: ResetBody, request: Request) -> Any:
        opened = await store.open(request.client.host if request.client else "unknown")
        if isinstance(opened, str):
            return _error(429, opened)
        sid, session = opened
        task = Task(**body.task.model_dump())
        try:
            async with session.lock:
                messages, reset_info = await session.runner.run(
                    session.env.reset(seed=body.seed, options={"task": task}), step_timeout_s
                )
                tools = session.env.tools.schemas()
        except asyncio.TimeoutError:  # on 3.10 not the builtin TimeoutError
            store.close(sid)
            return _error(504, f"env.reset took over {step_timeout_s:g}s (--step-timeout-s)")
        except Exception as e:
            store.close(sid)
            return _error(500, f"env.reset raised {type(e).__name__}: {e}")
        return {
            "session_id": sid,
            "messages": [m.to_dict() for m in messages],
            "info": _jsonable(reset_info or {}),
            "tools": tools,
            "stop": list(session.env.stop),
            "max_observation_tokens": session.env.max_observation_tokens,
        }

    @app.post("/sessions/{sid}/step")
    async def step(sid: str, body: StepBody) -> Any:
        await store.expire()
        session = store.get(sid)
        if session is None:
            return _error(404, f"session {sid!r} is unknown or expired (--session-ttl-s)")
        action = Message.from_dict(body.action.model_dump())
        async with session.lock:
            if session.ended is not None:
                return _error(
                    409,
                    f"session {sid!r}: the episode is over ({session.ended}); POST /sessions "
                    "starts the next one",
                )
            try:
                result = await session.runner.run(session.env.step(action), step_timeout_s)
            except asyncio.TimeoutError:  # on 3.10 not the builtin TimeoutError
                store.close(sid)  # its thread closes the env once the step returns
                return _error(
                    504,
                    f"env.step took over {step_timeout_s:g}s (--step-timeout-s); session "
                    f"{sid!r} is closed",
                )
            except Exception as e:
                return _error(500, f"env.step raised {type(e).__name__}: {e}")
            finally:
                session.last_used = store.clock()  # a long step is not idleness
            if result.terminated or result.truncated:
                session.ended = "terminated" if result.terminated else "truncated"
        return _step_reply(result)

    @app.delete("/sessions/{sid}")
    async def close(sid: str) -> dict[str, Any]:
        await store.expire()
        return {"closed": store.close(sid)}

    return app


def make_env_app(env_id: str, env_kwargs: dict[str, Any], **app_options: Any) -> FastAPI:
    """The app serving the registered env `env_id` (`app_options`: `create_env_app`'s limits
    and key). One env is built and closed first, so bad kwargs fail here, not in every reset."""
    import functools

    from agentrl.envs.registry import spec

    env_spec = spec(env_id)
    env_spec.check_kwargs(env_kwargs)
    asyncio.run(env_spec.make(**env_kwargs).close())
    return create_env_app(
        functools.partial(env_spec.make, **env_kwargs),
        env_spec.load_class(),
        env_kwargs={**env_spec.kwargs, **env_kwargs},
        **app_options,
    )


def serve_env(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8100) -> None:
    """Blocking: serve `app` (`make_env_app`) until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning")
