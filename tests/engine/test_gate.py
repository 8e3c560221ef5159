"""GatedEngine: a weight update lets running turns finish on the old weights, holds the next
turns until it is done, and never aborts one."""

from __future__ import annotations

import asyncio

from agentrl.engine.base import Completion, FinishReason, SamplingParams
from agentrl.engine.gate import GatedEngine


class SlowEngine:
    """Each generate takes 50 ms and reports the version it started with."""

    def __init__(self) -> None:
        self.weight_version = "0"
        self.tokenizer = "tok"

    async def generate(self, input_ids, sampling, *, routing_key=None) -> Completion:
        version = self.weight_version
        await asyncio.sleep(0.05)
        return Completion([1], [-0.5], FinishReason.STOP, version)

    async def update_weights(self, named_tensors, *, weight_version: str) -> None:
        self.weight_version = weight_version


async def test_an_update_drains_running_turns_and_holds_new_ones():
    gated = GatedEngine(SlowEngine())
    assert gated.tokenizer == "tok"  # the rest is delegated
    running = asyncio.create_task(gated.generate([0], SamplingParams()))
    await asyncio.sleep(0.01)
    events: list[str] = []

    async def update() -> None:
        async with gated.paused():
            events.append(f"update starts, {gated.num_running} running")
            await gated.update_weights([], weight_version="1")
            await asyncio.sleep(0.05)

    updating = asyncio.create_task(update())
    await asyncio.sleep(0.01)
    held = asyncio.create_task(gated.generate([0], SamplingParams()))
    await asyncio.sleep(0.01)
    assert gated.num_waiting == 1
    before, after = await running, await held
    await updating
    assert events == ["update starts, 0 running"]
    assert before.weight_version == "0" and after.weight_version == "1"
    assert FinishReason.ABORT not in (before.finish_reason, after.finish_reason)
    assert gated.num_turns_held == 1


async def test_busy_seconds_count_time_with_a_generation_running():
    gated = GatedEngine(SlowEngine())
    await asyncio.gather(*(gated.generate([0], SamplingParams()) for _ in range(3)))
    await asyncio.sleep(0.05)
    assert 0.04 < gated.busy_seconds() < 0.09  # overlapping calls count once; idle time not at all
