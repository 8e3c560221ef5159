"""`/update_weight_version` through agentrl's `SGLangEngine`: the new version is what
`/model_info` and later responses report, and requests in flight are not aborted (SGLang's
default, `abort_all_requests: true`, would abort them)."""

from __future__ import annotations

import asyncio

import httpx

from agentrl.engine.base import FinishReason, SamplingParams
from agentrl.engine.sglang import SGLangEngine
from tests.support.sglang_real import StandInServer


async def test_version_update_keeps_requests_in_flight(sglang_server: StandInServer) -> None:
    engine = SGLangEngine(sglang_server.url)
    with sglang_server.holding():
        task = asyncio.ensure_future(engine.generate([1, 1], SamplingParams(max_new_tokens=3)))
        await sglang_server.wait_until(lambda s: s["num_running"] == 1, "running")
        await engine.weights.update_weight_version(7)
    completion = await asyncio.wait_for(task, 30)
    assert completion.finish_reason is FinishReason.LENGTH
    assert completion.weight_version == 7
    assert await engine.get_weight_version() == 7  # read back from /model_info
    await engine.close()


async def test_sglangs_default_aborts_requests_in_flight(sglang_server: StandInServer) -> None:
    """What agentrl must not send: the route's default aborts everything running."""
    engine = SGLangEngine(sglang_server.url)
    with sglang_server.holding():
        task = asyncio.ensure_future(engine.generate([2, 2], SamplingParams(max_new_tokens=3)))
        await sglang_server.wait_until(lambda s: s["num_running"] == 1, "running")
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(
                f"{sglang_server.url}/update_weight_version", json={"new_version": "8"}
            )
    completion = await asyncio.wait_for(task, 30)
    assert response.status_code == 200
    assert completion.finish_reason is FinishReason.ABORT
    await engine.close()
