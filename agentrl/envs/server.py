"""`agentrl env serve`: any `AgentEnv` over HTTP, one session (env instance) per episode.

Routes: `GET /info` (tool-call format, stop strings, limits), `GET /tasks?split=`,
`POST /sessions` (reset), `POST /sessions/{id}/step`, `DELETE /sessions/{id}` (close),
`GET /health`. At most `max_sessions` live at once (429 beyond); a session idle for
`session_ttl_s` is closed and forgotten (an abandoned client never leaks an env)."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from agentrl.envs.base import AgentEnv
from agentrl.types import Message, Task


class ResetBody(BaseModel):
    task: dict[str, Any]
    seed: int | None = None


class StepBody(BaseModel):
    action: dict[str, Any]


@dataclass
class _Session:
    env: AgentEnv
    last_used: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status)


def _jsonable(value: Any) -> Any:
    """Env infos may hold numpy numbers or paths: anything JSON cannot write becomes text."""
    return json.loads(json.dumps(value, default=str))


class SessionStore:
    """Live sessions, bounded in number, each closed once idle past `ttl_s` (`clock` injectable)."""

    def __init__(
        self,
        env_factory: Callable[[], AgentEnv],
        *,
        max_sessions: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions={max_sessions}: use an int >= 1")
        if ttl_s <= 0:
            raise ValueError(f"session_ttl_s={ttl_s}: use a number of seconds > 0")
        self.env_factory, self.clock = env_factory, clock
        self.max_sessions, self.ttl_s = max_sessions, ttl_s
        self.sessions: dict[str, _Session] = {}

    async def expire(self) -> list[str]:
        """Close every session idle past the TTL; their ids."""
        now = self.clock()
        stale = [
            sid
            for sid, s in self.sessions.items()
            if now - s.last_used > self.ttl_s and not s.lock.locked()  # mid-step is not idle
        ]
        for sid in stale:
            await self.close(sid)
        return stale

    async def open(self) -> tuple[str, _Session] | None:
        """A new session, or None when `max_sessions` are live."""
        await self.expire()
        if len(self.sessions) >= self.max_sessions:
            return None
        sid = secrets.token_urlsafe(12)
        session = _Session(self.env_factory(), self.clock())
        self.sessions[sid] = session
        return sid, session

    def get(self, sid: str) -> _Session | None:
        session = self.sessions.get(sid)
        if session is not None:
            session.last_used = self.clock()
        return session

    async def close(self, sid: str) -> bool:
        session = self.sessions.pop(sid, None)
        if session is None:
            return False
        try:
            await session.env.close()
        except Exception:  # the episode is over either way; the server keeps serving
            traceback.print_exc()
        return True


def create_env_app(
    env_factory: Callable[[], AgentEnv],
    env_cls: type[AgentEnv],
    *,
    env_kwargs: dict[str, Any] | None = None,
    max_sessions: int = 64,
    session_ttl_s: float = 600.0,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """The app serving envs made by `env_factory` (instances of `env_cls`)."""
    store = SessionStore(env_factory, max_sessions=max_sessions, ttl_s=session_ttl_s, clock=clock)
    app = FastAPI(title=f"agentrl env serve: {env_cls.__name__}")
    app.state.sessions = store

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "body"
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}")

    @app.get("/health")
    async def health() -> dict[str, Any]:
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
            "session_ttl_s": store.ttl_s,
        }

    @app.get("/tasks")
    async def tasks(split: str = "train") -> Any:
        try:
            found = await asyncio.to_thread(env_cls.load_tasks, split, **(env_kwargs or {}))
        except (NotImplementedError, TypeError, ValueError) as e:
            return _error(400, f"split={split!r}: {e}")
        return [t.to_dict() for t in found]

    @app.post("/sessions")
    async def reset(body: ResetBody) -> Any:
        opened = await store.open()
        if opened is None:
            return _error(429, f"{store.max_sessions} sessions are live (--max-sessions); retry")
        sid, session = opened
        try:
            async with session.lock:
                messages, reset_info = await session.env.reset(
                    seed=body.seed, options={"task": Task(**body.task)}
                )
                tools = session.env.tools.schemas()
        except Exception as e:
            await store.close(sid)
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
        session = store.get(sid)
        if session is None:
            return _error(404, f"session {sid!r} is unknown or expired (--session-ttl-s)")
        try:
            async with session.lock:
                result = await session.env.step(Message.from_dict(body.action))
        except Exception as e:
            return _error(500, f"env.step raised {type(e).__name__}: {e}")
        finally:
            session.last_used = store.clock()  # a long step is not idleness
        return {
            "observation": [m.to_dict() for m in result.observation],
            "reward": float(result.reward),
            "terminated": bool(result.terminated),
            "truncated": bool(result.truncated),
            "info": _jsonable(result.info or {}),
        }

    @app.delete("/sessions/{sid}")
    async def close(sid: str) -> dict[str, Any]:
        return {"closed": await store.close(sid)}

    return app


def serve_env(
    env_id: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8100,
    env_kwargs: dict[str, Any] | None = None,
    max_sessions: int = 64,
    session_ttl_s: float = 600.0,
) -> None:
    """Blocking: serve the registered env `env_id` until interrupted."""
    import functools

    import uvicorn

    from agentrl.envs.registry import spec

    env_spec = spec(env_id)
    env_spec.check_kwargs(env_kwargs or {})
    app = create_env_app(
        functools.partial(env_spec.make, **(env_kwargs or {})),
        env_spec.load_class(),
        env_kwargs={**env_spec.kwargs, **(env_kwargs or {})},
        max_sessions=max_sessions,
        session_ttl_s=session_ttl_s,
    )
    uvicorn.run(app, host=host, port=port, log_level="warning")
