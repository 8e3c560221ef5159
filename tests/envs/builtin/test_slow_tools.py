"""The `slow_tools` env: registered and valid, seeded long-tailed latency, scored last turn."""

from __future__ import annotations

import asyncio
import statistics

from agentrl.envs import check_env, make
from agentrl.envs.builtin.slow_tools import SlowToolsEnv
from agentrl.types import Message


def test_slow_tools_passes_check_env():
    check_env("slow_tools")


def test_latency_is_long_tailed_p99_at_least_10x_the_median():
    env = SlowToolsEnv()
    draws = sorted(env._draw_latency() for _ in range(20_000))
    median, p99 = statistics.median(draws), draws[int(0.99 * len(draws))]
    assert p99 / median >= 10


def test_episode_runs_num_turns_and_scores_the_last():
    async def play() -> tuple[list, float]:
        env = make("slow_tools", num_turns=2, median_latency_s=0.001)
        await env.reset(seed=3)
        first = await env.step(Message(role="assistant", content="hmm"))
        last = await env.step(Message(role="assistant", content=f"<answer>{env.value}</answer>"))
        return [first.terminated, last.terminated, env.latencies_s], last.reward

    (first_done, last_done, latencies), reward = asyncio.run(play())
    assert (first_done, last_done, reward) == (False, True, 1.0)
    assert len(latencies) == 1
