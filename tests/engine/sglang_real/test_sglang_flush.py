"""`/flush_cache` through agentrl's `SGLangEngine` against SGLang's route: refused (400) while a
request runs, retried by agentrl until it goes through, and the prefix cache is empty after."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from agentrl.engine.base import EngineError, SamplingParams
from agentrl.engine.sglang import SGLangEngine
from tests.support.sglang_real import StandInServer


async def test_flush_is_refused_while_requests_run(sglang_server: StandInServer) -> None:
    engine = SGLangEngine(sglang_server.url)
    with sglang_server.holding():
        task = asyncio.ensure_future(engine.generate([3, 1], SamplingParams(max_new_tokens=2)))
        await sglang_server.wait_until(lambda s: s["num_running"] == 1, "running")
        raw = httpx.post(f"{sglang_server.url}/flush_cache", timeout=10)
        with pytest.raises(EngineError, match="flush_cache"):
            await engine.flush_cache(max_wait_s=0.3, poll_interval_s=0.05)
    await asyncio.wait_for(task, 30)
    assert raw.status_code == 400
    await engine.close()


async def test_flush_empties_the_prefix_cache(sglang_server: StandInServer) -> None:
    engine = SGLangEngine(sglang_server.url)
    prompt = [5, 6, 7, 8]
    first = await engine.generate(prompt, SamplingParams(max_new_tokens=2))
    assert (
        await engine.generate(prompt + first.ids, SamplingParams(max_new_tokens=1))
    ).cached_tokens
    await engine.flush_cache()
    again = await engine.generate(prompt + first.ids, SamplingParams(max_new_tokens=1))
    assert again.cached_tokens == 0
    await engine.close()


async def test_flush_waits_for_running_requests_to_finish(sglang_server: StandInServer) -> None:
    engine = SGLangEngine(sglang_server.url)
    task = asyncio.ensure_future(engine.generate([4, 4], SamplingParams(max_new_tokens=2)))
    with sglang_server.holding():
        await sglang_server.wait_until(lambda s: s["num_running"] == 1, "running")
        flush = asyncio.ensure_future(engine.flush_cache(max_wait_s=30, poll_interval_s=0.05))
        await asyncio.sleep(0.2)
        assert not flush.done()  # refused (400) and retried while the request runs
    await asyncio.wait_for(asyncio.gather(task, flush), 30)
    assert sglang_server.state()["num_cached_sequences"] == 0
    await engine.close()
