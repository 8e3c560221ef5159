"""GatedEngine: a weight update lets running turns finish on the old weights, holds the next
turns until it is done, and never aborts one. The test releases each generation itself (no
sleeps) and times the busy seconds with its own clock."""

from __future__ import annotations

import asyncio

from agentrl.engine.base import Completion, FinishReason, SamplingParams
from agentrl.engine.gate import GatedEngine


class HeldEngine:
    """Each generate reports the version it started with and returns once the test releases it;
    `all_inside` is set when `expected` generations are inside at once."""

    def __init__(self, expected: int = 1) -> None:
        self.weight_version = 0
        self.tokenizer = "tok"
        self.release, self.all_inside = asyncio.Event(), asyncio.Event()
        self.expected, self.inside = expected, 0

    async def generate(self, input_ids, sampling, *, routing_key=None) -> Completion:
        version = self.weight_version
        self.inside += 1
        if self.inside == self.expected:
            self.all_inside.set()
        await self.release.wait()
        return Completion([1], [-0.5], FinishReason.STOP, version)

    async def update_weights(self, named_tensors, *, weight_version: int) -> None:
        self.weight_version = weight_version


async def test_an_update_drains_running_turns_and_holds_new_ones():
    engine = HeldEngine()
    gated = GatedEngine(engine)
    assert gated.tokenizer == "tok"  # the rest is delegated
    running = asyncio.create_task(gated.generate([0], SamplingParams()))
    await engine.all_inside.wait()  # running is in the engine, on version 0
    events: list[str] = []

    async def update() -> None:
        async with gated.paused():
            events.append(
                f"update starts, {gated.num_running} running, {gated.num_turns_held} held"
            )
            await gated.update_weights([], weight_version=1)

    # tasks start in the order they were made: the update closes the gate before the turn
    # arrives, and both before the running turn is released
    updating = asyncio.create_task(update())
    held = asyncio.create_task(gated.generate([0], SamplingParams()))
    engine.release.set()
    before, after = await running, await held
    await updating
    assert events == ["update starts, 0 running, 1 held"]
    assert before.weight_version == 0 and after.weight_version == 1
    assert FinishReason.ABORT not in (before.finish_reason, after.finish_reason)
    assert gated.num_turns_held == 1


async def test_busy_seconds_count_time_with_a_generation_running():
    now = [100.0]
    engine = HeldEngine(expected=3)
    gated = GatedEngine(engine, clock=lambda: now[0])
    calls = [asyncio.create_task(gated.generate([0], SamplingParams())) for _ in range(3)]
    await engine.all_inside.wait()
    now[0] += 0.5
    assert gated.busy_seconds() == 0.5  # a running generation counts up to now
    engine.release.set()
    await asyncio.gather(*calls)
    now[0] += 7.0  # idle: not counted
    assert gated.busy_seconds() == 0.5  # overlapping calls count once
