"""Pause and continue through agentrl's `SGLangEngine` against SGLang's routes, in each of
SGLang's modes: abort (in-flight requests end ABORT), retract (they go back to the queue, keep
their tokens and finish after continue) and in_place (they stay running, frozen)."""

from __future__ import annotations

import asyncio

from agentrl.engine.base import FinishReason, SamplingParams
from agentrl.engine.sglang import SGLangEngine
from tests.support.sglang_real import StandInServer


def running(n: int):
    return lambda state: state["num_running"] == n


async def test_retract_requeues_and_continue_finishes(sglang_server: StandInServer) -> None:
    engine = SGLangEngine(sglang_server.url)
    with sglang_server.holding():
        task = asyncio.ensure_future(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4)))
        await sglang_server.wait_until(running(1), "the request running")
        await engine.pause_generation("retract")
        state = await sglang_server.wait_until(lambda s: s["num_waiting"] == 1, "retracted")
        assert state["num_running"] == 0 and state["is_pause"]
        await engine.flush_cache()  # a paused engine ignores its queue: the flush goes through
        await engine.continue_generation()
    completion = await asyncio.wait_for(task, 30)
    assert completion.finish_reason is FinishReason.LENGTH
    assert len(completion.ids) == 4
    await engine.close()


async def test_abort_mode_ends_in_flight_requests_and_holds_new_ones(
    sglang_server: StandInServer,
) -> None:
    engine = SGLangEngine(sglang_server.url)
    with sglang_server.holding():
        task = asyncio.ensure_future(engine.generate([4, 5], SamplingParams(max_new_tokens=4)))
        await sglang_server.wait_until(running(1), "the request running")
        await engine.pause_generation("abort")
        aborted = await asyncio.wait_for(task, 30)
    later = asyncio.ensure_future(engine.generate([6], SamplingParams(max_new_tokens=2)))
    await asyncio.sleep(0.3)  # not a timing assertion: gives a wrongly admitted request a chance
    assert not later.done() and sglang_server.state()["num_running"] == 0
    await engine.continue_generation()
    finished = await asyncio.wait_for(later, 30)
    assert aborted.finish_reason is FinishReason.ABORT
    assert finished.finish_reason is FinishReason.LENGTH
    await engine.close()


async def test_in_place_keeps_requests_running_until_continue(
    sglang_server: StandInServer,
) -> None:
    engine = SGLangEngine(sglang_server.url)
    task = asyncio.ensure_future(engine.generate([7, 8], SamplingParams(max_new_tokens=3)))
    with sglang_server.holding():
        await sglang_server.wait_until(running(1), "the request running")
        await engine.pause_generation("in_place")
    state = await sglang_server.wait_until(lambda s: s["pause_mode"] == "in_place", "paused")
    assert state["num_running"] == 1 and not task.done()
    await engine.continue_generation()
    completion = await asyncio.wait_for(task, 30)
    assert completion.finish_reason is FinishReason.LENGTH and len(completion.ids) == 3
    await engine.close()
