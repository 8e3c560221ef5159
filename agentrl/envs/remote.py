"""`RemoteEnv`: an env served by `agentrl env serve`, used exactly like a local one.

Each instance holds one server session (one episode). A server that dies or answers with an
error makes `reset`/`step` raise `RemoteEnvError`, which the rollout records as ERROR/env:
an infrastructure failure, never a reward of 0. A server started with a key gets it from
`AGENTRL_API_KEY` (`Authorization: Bearer`), never from the run's config."""

from __future__ import annotations

import functools
import os
from typing import Any

import httpx

from agentrl.envs.base import AgentEnv, EnvLoadError, StepResult
from agentrl.types import Message, Task

API_KEY_ENV = "AGENTRL_API_KEY"  # what `agentrl env serve --api-key` reads too


class RemoteEnvError(RuntimeError):
    """The env server could not be reached or refused the call."""


class EnvServerUnavailable(EnvLoadError):
    """Before a run: the env server at `--env http://...` did not answer as one (a user's
    error, said in one line)."""


def _auth_headers() -> dict[str, str]:
    key = os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


class RemoteTools:
    """The served env's tool schemas (the tools themselves run on the server)."""

    def __init__(self, schemas: list[dict[str, Any]] | None = None) -> None:
        self._schemas = list(schemas or [])
        self.tokenizer: Any = None  # the runner sets it; the server cuts its own outputs

    def schemas(self) -> list[dict[str, Any]]:
        return list(self._schemas)

    def __len__(self) -> int:
        return len(self._schemas)


class RemoteEnv(AgentEnv):
    """`--env agentrl.envs.remote:RemoteEnv --set env.kwargs.url=http://127.0.0.1:8100`."""

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"env.kwargs.url={url!r}: give the env server's http:// URL")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.tools = RemoteTools()  # type: ignore[assignment]
        self._session: str | None = None
        self._client: httpx.AsyncClient | None = None

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.url, timeout=self.timeout_s, headers=_auth_headers()
            )
        try:
            response = await self._client.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise RemoteEnvError(f"env server {self.url}: {type(e).__name__}: {e}") from e
        return _json_or_raise(response, self.url, path)

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        await self._end_session()
        task = (options or {}).get("task")
        if not isinstance(task, Task):
            raise ValueError("RemoteEnv.reset needs options={'task': Task(...)}")
        out = await self._call("POST", "/sessions", {"task": task.to_dict(), "seed": seed})
        self._session = out["session_id"]
        self.tools = RemoteTools(out.get("tools"))  # type: ignore[assignment]
        self.stop = tuple(out.get("stop") or ())  # type: ignore[misc]
        self.max_observation_tokens = out.get("max_observation_tokens")
        return [Message.from_dict(m) for m in out["messages"]], out.get("info") or {}

    async def step(self, action: Message) -> StepResult:
        if self._session is None:
            raise RemoteEnvError("step before reset: no session on the env server")
        out = await self._call(
            "POST", f"/sessions/{self._session}/step", {"action": action.to_dict()}
        )
        return StepResult(
            observation=[Message.from_dict(m) for m in out["observation"]],
            reward=float(out["reward"]),
            terminated=bool(out["terminated"]),
            truncated=bool(out["truncated"]),
            info=out.get("info") or {},
        )

    async def _end_session(self) -> None:
        sid, self._session = self._session, None
        if sid is not None:
            await self._call("DELETE", f"/sessions/{sid}")

    async def close(self) -> None:
        try:
            await self._end_session()
        finally:
            if self._client is not None:
                await self._client.aclose()
                self._client = None

    default_url = ""  # set by `bound_to`: `--env http://host:port` needs no env.kwargs.url

    @classmethod
    def bound_to(cls, url: str) -> type[RemoteEnv]:
        """A RemoteEnv class whose `url` defaults to `url` (what `--env http://...` builds)."""

        class Bound(RemoteEnv):
            default_url = url

            def __init__(self, url: str = url, timeout_s: float = 600.0) -> None:
                super().__init__(url, timeout_s)

        Bound.__name__ = Bound.__qualname__ = f"RemoteEnv({url})"
        Bound.__doc__ = f"The env served at {url}."
        return Bound

    @classmethod
    def load_tasks(cls, split: str, url: str = "", **kwargs: Any) -> list[Task]:
        """The served env's own split, fetched from its server."""
        out = _get(url or cls.default_url, "/tasks", params={"split": split})
        return [Task(**t) for t in out]


@functools.lru_cache(maxsize=16)
def server_info(url: str) -> dict[str, Any]:
    """`GET /info` of an env server (its tool-call format, stop strings, limits)."""
    return _get(url, "/info")


def _get(url: str, path: str, params: dict[str, Any] | None = None) -> Any:
    """A GET a run makes before it starts (the server's info, its tasks): any failure is
    `EnvServerUnavailable`, one line naming the URL and what answered."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"env.kwargs.url={url!r}: give the env server's http:// URL")
    where = url.rstrip("/") + path
    try:
        response = httpx.get(where, params=params, timeout=60, headers=_auth_headers())
    except httpx.HTTPError as e:
        raise EnvServerUnavailable(
            f"env server {url}: nothing answered GET {path} ({type(e).__name__}: "
            f"{str(e) or 'no reply'}); start it with `agentrl env serve ENV_ID --host HOST "
            "--port PORT`, or fix the URL"
        ) from None
    if response.status_code == 401:
        raise EnvServerUnavailable(
            f"env server {url} wants an API key (HTTP 401 on GET {path}); export "
            f"{API_KEY_ENV}=<the key the server was started with>"
        )
    try:
        return _json_or_raise(response, url, path)
    except RemoteEnvError as e:
        hint = "; is it an `agentrl env serve`?" if response.status_code == 404 else ""
        raise EnvServerUnavailable(f"{e}{hint}") from None
    except ValueError:  # a web server, but not one that speaks JSON
        raise EnvServerUnavailable(
            f"env server {url}: GET {path} answered HTTP {response.status_code}, not JSON; is it "
            "an `agentrl env serve`?"
        ) from None


def _json_or_raise(response: httpx.Response, url: str, path: str) -> Any:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = " ".join(response.text.split())[:120]  # an HTML page, on one line
        if response.status_code == 401:
            message += f" (export {API_KEY_ENV}=<the key the env server was started with>)"
        raise RemoteEnvError(f"env server {url}{path}: HTTP {response.status_code}: {message}")
    return response.json()
