"""Generation through agentrl's `SGLangEngine` against SGLang's own `/generate` route: sampled
ids and logprobs verbatim, finish reasons, cached tokens, weight version, SGLang's refusals."""

from __future__ import annotations

import asyncio

import httpx

from agentrl.engine.base import FinishReason, SamplingParams
from agentrl.engine.sglang import SGLangEngine
from agentrl.engine.sglang.protocol import version_from_wire
from tests.engine.sglang_real.standin_requests import fake_logprob, fake_token
from tests.support.sglang_real import StandInServer, sglang_version


def expected_ids(prompt: list[int], num_tokens: int) -> list[int]:
    key = sum(prompt) + len(prompt)
    return [fake_token(key, step) for step in range(num_tokens)]


async def test_ids_and_logprobs_are_the_servers_verbatim(sglang_server: StandInServer) -> None:
    engine = SGLangEngine(sglang_server.url)
    prompt = [11, 12, 13]
    completion = await engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=5))
    ids = expected_ids(prompt, 5)
    assert completion.ids == ids
    assert completion.logprobs == [fake_logprob(t) for t in ids]
    assert completion.finish_reason is FinishReason.LENGTH
    assert completion.prompt_tokens == 3
    await engine.close()


async def test_stop_token_finishes_with_stop_and_the_matched_id(
    sglang_server: StandInServer,
) -> None:
    engine = SGLangEngine(sglang_server.url)
    prompt = [21, 22]
    stop_id = expected_ids(prompt, 3)[2]
    sampling = SamplingParams(max_new_tokens=10, stop_token_ids=[stop_id])
    completion = await engine.generate(prompt, sampling)
    assert completion.finish_reason is FinishReason.STOP
    assert completion.matched_stop == stop_id
    assert completion.ids == expected_ids(prompt, 3)  # the stop token is kept (no_stop_trim)
    await engine.close()


async def test_cached_tokens_count_the_prefix_the_server_holds(
    sglang_server: StandInServer,
) -> None:
    engine = SGLangEngine(sglang_server.url)
    prompt = [31, 32, 33, 34]
    first = await engine.generate(prompt, SamplingParams(max_new_tokens=3))
    follow_up = prompt + first.ids + [35, 36]  # the next turn of the same episode
    second = await engine.generate(follow_up, SamplingParams(max_new_tokens=2))
    assert first.cached_tokens == 0
    assert second.cached_tokens == len(prompt) + len(first.ids)
    await engine.close()


async def test_weight_version_is_the_servers(sglang_server: StandInServer) -> None:
    engine = SGLangEngine(sglang_server.url)
    served = await engine.get_weight_version()  # /model_info (0.5.15+: /get_weight_version is 404)
    completion = await engine.generate([41], SamplingParams(max_new_tokens=1))
    # SGLang's own tag ("default" before any update) read as agentrl's int policy version
    wire = sglang_server.state()["weight_version"]
    assert completion.weight_version == served == version_from_wire(wire)
    await engine.close()


async def test_the_dialect_is_read_from_server_info(sglang_server: StandInServer) -> None:
    engine = SGLangEngine(sglang_server.url)
    dialect = await engine.dialect()
    assert dialect.version == sglang_version()
    assert dialect.is_agentrl_serve is False
    assert (await engine.tp_size()) == 1
    await engine.close()


async def test_every_sampling_key_agentrl_sends_is_one_sglang_accepts(
    sglang_server: StandInServer,
) -> None:
    """SGLang answers 400 to an unknown sampling key; agentrl sends all of its keys, seed included."""
    engine = SGLangEngine(sglang_server.url)
    sampling = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=2, stop=["x"], seed=3
    )
    completion = await engine.generate([51, 52], sampling)
    assert len(completion.ids) == 2
    bad = httpx.post(
        f"{sglang_server.url}/generate",
        json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "no_such_key": 1}},
        timeout=30,
    )
    assert bad.status_code == 400
    assert "no_such_key" in bad.text
    await engine.close()


async def test_a_live_rid_is_refused_and_agentrl_never_reuses_one(
    sglang_server: StandInServer,
) -> None:
    engine = SGLangEngine(sglang_server.url)
    body = {"rid": "same-rid", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    sampling = SamplingParams(max_new_tokens=2)
    async with httpx.AsyncClient(timeout=30) as client:
        with sglang_server.holding():
            first = asyncio.ensure_future(client.post(f"{sglang_server.url}/generate", json=body))
            await sglang_server.wait_until(lambda s: "same-rid" in s["running_rids"], "rid running")
            second = await client.post(f"{sglang_server.url}/generate", json=body)
            tasks = [asyncio.ensure_future(engine.generate([7, 8], sampling)) for _ in range(2)]
            state = await sglang_server.wait_until(lambda s: s["num_running"] == 3, "3 running")
        assert second.status_code == 400
        assert "Duplicate request ID" in second.text
        assert len(set(state["running_rids"])) == 3  # agentrl's two rids are fresh and distinct
        assert (await first).status_code == 200
        assert all(c.finish_reason is FinishReason.LENGTH for c in await asyncio.gather(*tasks))
    await engine.close()
