"""`agentrl env serve` and `RemoteEnv` over real HTTP: an episode against a served env equals
the in-process one token for token; sessions are bounded and expire; a dead server is ERROR/env."""

from __future__ import annotations

import httpx
import pytest

from agentrl.engine.base import SamplingParams
from agentrl.envs.builtin.calculator import CalculatorEnv
from agentrl.envs.remote import RemoteEnv, RemoteEnvError, server_info
from agentrl.envs.server import create_env_app
from agentrl.rollout.codec import ChatCodec
from agentrl.rollout.episode import run_episode
from agentrl.types import EpisodeStatus, StatusReason
from tests.rollout.conftest import ScriptedEngine, load_tokenizer
from tests.support.servers import run_app_in_thread


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


@pytest.fixture
def served():
    clock = [0.0]
    app = create_env_app(
        CalculatorEnv, CalculatorEnv, max_sessions=2, session_ttl_s=10, clock=lambda: clock[0]
    )
    thread = run_app_in_thread(app)
    yield thread.url, clock, app
    thread.stop()


REPLIES = ['<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>',
           "<answer>5</answer>"]  # fmt: skip


async def _episode(env, tokenizer):
    task = CalculatorEnv.load_tasks("train")[0]
    return await run_episode(
        env,
        ScriptedEngine(tokenizer, REPLIES),
        ChatCodec(tokenizer),
        task,
        SamplingParams(max_new_tokens=256, seed=3),
        max_turns=3,
        max_context_len=4096,
    )


async def test_served_env_plays_the_same_episode_as_in_process(served, smol_tokenizer):
    url, _, _ = served
    local = await _episode(CalculatorEnv(), smol_tokenizer)
    remote = await _episode(RemoteEnv(url), smol_tokenizer)
    assert remote.status is EpisodeStatus.COMPLETED and remote.num_turns == 2
    assert (remote.token_ids, remote.loss_mask, remote.reward) == (
        local.token_ids,
        local.loss_mask,
        local.reward,
    )
    assert RemoteEnv.load_tasks("test", url=url) == CalculatorEnv.load_tasks("test")
    assert server_info(url)["tool_call_format"] == "hermes"


async def test_an_env_id_that_is_a_url_names_the_served_env(served, smol_tokenizer):
    """`--env http://host:port`: the registry builds a RemoteEnv bound to that URL, so neither
    the env nor its tasks need env.kwargs.url."""
    from agentrl.envs import make
    from agentrl.envs.registry import spec
    from agentrl.rollout.group import _tool_call_format

    url, _, _ = served
    env_cls = spec(url).load_class()
    assert env_cls.load_tasks("test") == CalculatorEnv.load_tasks("test")
    assert _tool_call_format(env_cls, {}) == CalculatorEnv.tool_call_format  # from GET /info
    local = await _episode(CalculatorEnv(), smol_tokenizer)
    remote = await _episode(make(url), smol_tokenizer)
    assert (remote.token_ids, remote.reward) == (local.token_ids, local.reward)


async def test_sessions_are_bounded_and_expire(served):
    url, clock, app = served
    task = CalculatorEnv.load_tasks("train")[0]
    envs = [RemoteEnv(url) for _ in range(3)]
    from agentrl.types import Message

    for env in envs[:2]:
        await env.reset(options={"task": task})
    with pytest.raises(RemoteEnvError, match=r"HTTP 429: 2 sessions are live \(--max-sessions\)"):
        await envs[2].reset(options={"task": task})
    clock[0] = 11.0  # both idle past the TTL: the next open closes them
    await envs[2].reset(options={"task": task})
    assert len(app.state.sessions.sessions) == 1
    with pytest.raises(RemoteEnvError, match="HTTP 404: session .* unknown or expired"):
        await envs[0].step(Message("assistant", "<answer>1</answer>"))
    await envs[2].close()
    assert len(app.state.sessions.sessions) == 0
    async with httpx.AsyncClient() as client:
        r = await client.post(f"{url}/sessions", json={"seed": 1})
        assert (r.status_code, r.json()["error"]["message"]) == (400, "task: Field required")


async def test_a_dead_server_ends_the_episode_error_env(smol_tokenizer):
    from agentrl.deploy.processes import free_ports

    (port,) = free_ports(1)
    traj = await _episode(RemoteEnv(f"http://127.0.0.1:{port}"), smol_tokenizer)
    assert (traj.status, traj.status_reason) == (EpisodeStatus.ERROR, StatusReason.ENV)
    assert "RemoteEnvError" in traj.info["error"] and traj.info["error_where"] == "env.reset"


def test_remote_env_refuses_a_url_that_is_not_http():
    with pytest.raises(ValueError, match=r"env.kwargs.url='localhost:8100'"):
        RemoteEnv("localhost:8100")
