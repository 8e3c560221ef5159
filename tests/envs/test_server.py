"""`agentrl env serve`'s guards (issue 38): the API key before the body, the body limit, the
per-client session cap, a step off the server's loop under a time limit, 400 for client errors,
the TTL on every request, no step after the episode ended, and `RemoteEnv` sending the key."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.builtin.calculator import CalculatorEnv
from agentrl.envs.remote import RemoteEnv, RemoteEnvError
from agentrl.envs.server import create_env_app
from agentrl.types import Message, Task
from tests.support.servers import run_app_in_thread

TASK = CalculatorEnv.load_tasks("train")[0]
ANSWER = {"action": {"role": "assistant", "content": "<answer>1</answer>"}}


def _serve(env_factory=CalculatorEnv, env_cls=CalculatorEnv, **options):
    return run_app_in_thread(create_env_app(env_factory, env_cls, **options))


@pytest.fixture
def keyed():
    server = _serve(api_key="s3cret", max_body_bytes=4096)
    yield server.url
    server.stop()


def _open(client: httpx.Client, url: str, **kw) -> httpx.Response:
    return client.post(f"{url}/sessions", json={"task": TASK.to_dict()}, **kw)


def test_a_keyed_server_refuses_every_route_but_health_without_the_key(keyed):
    with httpx.Client() as client:
        assert client.get(f"{keyed}/health").status_code == 200
        for method, path in (("GET", "/info"), ("GET", "/tasks"), ("POST", "/sessions"),
                             ("POST", "/sessions/x/step"), ("DELETE", "/sessions/x")):  # fmt: skip
            r = client.request(method, f"{keyed}{path}", headers={"Authorization": "Bearer no"})
            assert r.status_code == 401, (method, path)
        # refused before the body is read: a body far over the limit still gets the 401
        r = client.post(f"{keyed}/sessions", content=b"x" * 100_000)
        assert r.status_code == 401
        assert _open(client, keyed, headers={"Authorization": "Bearer s3cret"}).status_code == 200


async def test_remote_env_sends_the_key_from_the_environment(keyed, monkeypatch):
    env = RemoteEnv(keyed)
    with pytest.raises(RemoteEnvError, match=r"HTTP 401.*export AGENTRL_API_KEY"):
        await env.reset(options={"task": TASK})
    await env.close()
    monkeypatch.setenv("AGENTRL_API_KEY", "s3cret")
    env = RemoteEnv(keyed)
    messages, _ = await env.reset(options={"task": TASK})
    assert messages[-1].role == "user"
    assert (await env.step(Message("assistant", "<answer>1</answer>"))).terminated
    assert RemoteEnv.load_tasks("train", url=keyed)[0] == TASK
    await env.close()


def test_a_body_over_the_limit_is_413(keyed):
    headers = {"Authorization": "Bearer s3cret"}
    with httpx.Client(headers=headers) as client:
        big = {"action": {"role": "assistant", "content": "x" * 10_000}}
        r = client.post(f"{keyed}/sessions/x/step", json=big)
        assert r.status_code == 413 and "--max-body-mb" in r.text


def test_one_client_cannot_hold_every_session():
    server = _serve(max_sessions=3, max_sessions_per_client=2)
    try:
        with httpx.Client() as client:
            assert [_open(client, server.url).status_code for _ in range(2)] == [200, 200]
            r = _open(client, server.url)
            assert r.status_code == 429
            assert "client 127.0.0.1 holds 2 sessions (--max-sessions-per-client)" in r.text
    finally:
        server.stop()


def test_client_errors_are_400_not_500():
    server = _serve()
    try:
        with httpx.Client() as client:
            sid = _open(client, server.url).json()["session_id"]
            step = f"{server.url}/sessions/{sid}/step"
            bad = [
                client.post(step, content=b"{not json", headers={"content-type": "application/json"}),
                client.post(step, json={"action": "hi"}),
                client.post(step, json={"action": {"role": "wizard", "content": "x"}}),
                client.post(step, json={"action": {"role": "assistant", "content": ["x"]}}),
                client.post(step, json={"action": {"role": "assistant", "tool_calls": [1]}}),
                client.post(f"{server.url}/sessions", json={"task": {"id": "t"}}),
                client.post(f"{server.url}/sessions", json={"task": []}),
            ]  # fmt: skip
            assert [r.status_code for r in bad] == [400] * len(bad), [r.text for r in bad]
            assert client.post(step, json=ANSWER).status_code == 200  # the session survived
    finally:
        server.stop()


def test_no_step_after_the_episode_ended():
    server = _serve()
    try:
        with httpx.Client() as client:
            sid = _open(client, server.url).json()["session_id"]
            first = client.post(f"{server.url}/sessions/{sid}/step", json=ANSWER)
            assert first.json()["terminated"] is True
            again = client.post(f"{server.url}/sessions/{sid}/step", json=ANSWER)
            assert again.status_code == 409
            assert "the episode is over (terminated)" in again.json()["error"]["message"]
    finally:
        server.stop()


def test_the_ttl_holds_on_every_request_not_only_on_a_new_session():
    clock = [0.0]
    app = create_env_app(CalculatorEnv, CalculatorEnv, session_ttl_s=10, clock=lambda: clock[0])
    server = run_app_in_thread(app)
    try:
        with httpx.Client() as client:
            sid = _open(client, server.url).json()["session_id"]
            clock[0] = 11.0  # idle past the TTL; no new session is opened after this
            assert client.get(f"{server.url}/health").json()["num_sessions"] == 0
            r = client.post(f"{server.url}/sessions/{sid}/step", json=ANSWER)
            assert r.status_code == 404 and "unknown or expired" in r.text
    finally:
        server.stop()


@pytest.mark.parametrize("ttl", [float("nan"), -1.0, 0.0, float("inf")])
def test_a_ttl_that_is_no_positive_number_is_refused(ttl):
    with pytest.raises(ValueError, match=r"--session-ttl-s=.*: use a finite number of seconds > 0"):
        create_env_app(CalculatorEnv, CalculatorEnv, session_ttl_s=ttl)


class BusyEnv(AgentEnv):
    """A step that holds its thread (CPU-bound, never awaiting) until released."""

    release = threading.Event()
    closed = threading.Event()

    async def reset(self, *, seed=None, options=None):
        return [Message("user", "go")], {}

    async def step(self, action: Message) -> StepResult:
        if action.content == "block":
            self.release.wait(60)  # no await: the loop it runs on is stuck meanwhile
        return StepResult(reward=1.0, terminated=True)

    async def close(self) -> None:
        self.closed.set()


def test_a_stuck_step_times_out_and_the_server_keeps_serving():
    server = _serve(BusyEnv, BusyEnv, step_timeout_s=0.5)
    blocked = {"action": {"role": "assistant", "content": "block"}}
    try:
        with httpx.Client(timeout=30) as client:
            stuck = _open(client, server.url).json()["session_id"]
            reply: dict = {}
            stepping = threading.Thread(
                target=lambda: reply.update(
                    r=client.post(f"{server.url}/sessions/{stuck}/step", json=blocked)
                )
            )
            stepping.start()
            time.sleep(0.1)
            # Meanwhile the server answers, and another session steps.
            assert client.get(f"{server.url}/health").status_code == 200
            other = _open(client, server.url).json()["session_id"]
            assert (
                client.post(f"{server.url}/sessions/{other}/step", json=ANSWER).json()["reward"]
                == 1.0
            )
            stepping.join(30)
            assert reply["r"].status_code == 504
            assert "--step-timeout-s" in reply["r"].json()["error"]["message"]
            gone = client.post(f"{server.url}/sessions/{stuck}/step", json=ANSWER)
            assert gone.status_code == 404  # the session ended with its step
            assert not BusyEnv.closed.is_set()  # still stepping: closed once the step returns
            BusyEnv.release.set()
            assert BusyEnv.closed.wait(30)
    finally:
        BusyEnv.release.set()
        server.stop()


async def test_a_session_env_lives_on_its_own_loop():
    """reset, step and close of one session run on one loop, not the server's."""
    loops: list[asyncio.AbstractEventLoop] = []

    class LoopEnv(CalculatorEnv):
        async def reset(self, *, seed=None, options=None):
            loops.append(asyncio.get_running_loop())
            return await super().reset(seed=seed, options=options)

        async def step(self, action):
            loops.append(asyncio.get_running_loop())
            return await super().step(action)

    server = _serve(LoopEnv, LoopEnv)
    try:
        env = RemoteEnv(server.url)
        await env.reset(options={"task": Task(TASK.id, TASK.data)})
        await env.step(Message("assistant", "<answer>1</answer>"))
        await env.close()
        assert len(loops) == 2 and loops[0] is loops[1]
        assert loops[0] is not asyncio.get_running_loop()
    finally:
        server.stop()


def _cli(*args: str) -> list[str]:
    from typer.testing import CliRunner

    from agentrl.cli import app

    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    return result.output.strip().splitlines()


def test_a_dead_env_url_is_one_line_naming_it(tmp_path):
    from agentrl.deploy.processes import free_ports

    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    lines = _cli("eval", "--env", url, "--num-tasks", "1", "--out", str(tmp_path / "e"))
    assert len(lines) == 1 and lines[0].startswith(f"error: env server {url}: nothing answered")


def test_a_difficulty_that_is_no_int_is_one_line(tmp_path):
    lines = _cli("eval", "--env", "calculator", "--set", "env.kwargs.difficulty=abc",
                 "--num-tasks", "1", "--out", str(tmp_path / "e"))  # fmt: skip
    assert len(lines) == 1 and "env.kwargs.difficulty='abc': use an int >= 1" in lines[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--session-ttl-s", "nan"], "error: --session-ttl-s=nan: use a finite number"),
        (["--max-sessions-per-client", "0"], "error: --max-sessions-per-client=0"),
        (
            ["--kwargs", '{"difficulty": "abc"}'],
            "error: env 'calculator': CalculatorEnv refused its arguments (env.kwargs): "
            "env.kwargs.difficulty='abc'",
        ),
        (["--kwargs", "[1]"], "error: --kwargs '[1]': give a JSON object"),
    ],
)
def test_env_serve_refuses_bad_options_in_one_line(flags, message):
    lines = _cli("env", "serve", "calculator", *flags)
    assert len(lines) == 1 and lines[0].startswith(message), lines


@pytest.mark.parametrize(("host", "made"), [("0.0.0.0", True), ("127.0.0.1", False)])
def test_env_serve_off_the_loopback_makes_a_key_and_serves_with_it(monkeypatch, host, made):
    import re

    from typer.testing import CliRunner

    from agentrl.cli import app
    from agentrl.envs import server

    served: dict = {}
    monkeypatch.setattr(server, "serve_env", lambda app, **kw: served.update(app=app, **kw))
    result = CliRunner().invoke(
        app,
        ["env", "serve", "calculator", "--host", host],
        env={"AGENTRL_API_KEY": "", "COLUMNS": "300"},
    )
    assert result.exit_code == 0, result.output
    keys = re.findall(r"AGENTRL_API_KEY=(\S+)", result.output)
    assert bool(keys) is made
    if made:
        with TestClient(served["app"]) as client:
            assert _open(client, "").status_code == 401
            headers = {"Authorization": f"Bearer {keys[0]}"}
            assert _open(client, "", headers=headers).status_code == 200
