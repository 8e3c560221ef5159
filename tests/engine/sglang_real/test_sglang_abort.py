"""Abort through agentrl's `SGLangEngine` against SGLang's `/abort_request`: a drain ends every
in-flight request ABORT and leaves the server idle; a cancelled caller frees its request."""

from __future__ import annotations

import asyncio
import contextlib

from agentrl.engine.base import FinishReason, SamplingParams
from agentrl.engine.sglang import SGLangEngine
from tests.support.sglang_real import StandInServer


async def test_abort_drains_every_request(sglang_server: StandInServer) -> None:
    engine = SGLangEngine(sglang_server.url)
    sampling = SamplingParams(max_new_tokens=5)
    with sglang_server.holding():
        tasks = [asyncio.ensure_future(engine.generate([i, i + 1], sampling)) for i in range(3)]
        await sglang_server.wait_until(lambda s: s["num_running"] == 3, "three running")
        await engine.abort(poll_interval_s=0.05, max_wait_s=30)
        state = sglang_server.state()
    completions = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert all(c.finish_reason is FinishReason.ABORT for c in completions)
    assert state["num_running"] == 0 and state["num_waiting"] == 0
    assert await engine.num_requests() == 0  # what agentrl reads from /v1/loads
    await engine.close()


async def test_a_cancelled_caller_aborts_its_request_on_the_server(
    sglang_server: StandInServer,
) -> None:
    engine = SGLangEngine(sglang_server.url)
    with sglang_server.holding():
        task = asyncio.ensure_future(engine.generate([9, 9], SamplingParams(max_new_tokens=5)))
        await sglang_server.wait_until(lambda s: s["num_running"] == 1, "running")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        state = await sglang_server.wait_until(lambda s: s["num_running"] == 0, "request freed")
    assert state["num_waiting"] == 0
    await engine.close()
