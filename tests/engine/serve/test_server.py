"""`agentrl serve` over real HTTP: SGLangEngine against it gives the same completions as the
in-process LocalEngine under fixed seeds, before and after weight updates; its responses have
SGLang's shapes (fixtures); pause, abort, memory release and the official `openai` client work."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from agentrl.engine.base import EngineError, FinishReason, SamplingParams
from agentrl.engine.sglang import SGLangEngine
from tests.engine.serve.parity import PROMPTS, both, seeded

FIXTURES = Path(__file__).parents[1] / "fixtures"
GENERATE = json.loads((FIXTURES / "sglang_generate.json").read_text())


async def test_http_generate_matches_in_process_engine_under_fixed_seeds(served, local) -> None:
    url, _ = served
    http = SGLangEngine(url)
    for i, prompt in enumerate(PROMPTS):
        for sampling in (seeded(i), SamplingParams(temperature=0.0, max_new_tokens=8)):
            want, got = await both(local, http, sampling, prompt)
            assert got.ids == want.ids
            assert got.logprobs == want.logprobs  # floats survive JSON exactly
            assert got.finish_reason is want.finish_reason
    await http.close()


async def test_concurrent_http_requests_are_batched_and_match(served, local) -> None:
    url, engine = served
    http = SGLangEngine(url)
    got = await asyncio.gather(*(http.generate(p, seeded(i)) for i, p in enumerate(PROMPTS * 2)))
    want = await asyncio.gather(*(local.generate(p, seeded(i)) for i, p in enumerate(PROMPTS * 2)))
    assert [c.ids for c in got] == [c.ids for c in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(
            w.logprobs, abs=1e-4
        )  # batch mates may move the last bits
    assert engine.stats.max_running_batch_size > 1
    await http.close()


async def test_generate_response_has_sglangs_shape(served) -> None:
    url, _ = served
    request = GENERATE["request"]
    async with httpx.AsyncClient() as client:
        out = (await client.post(f"{url}/generate", json=request)).json()
    fixture = GENERATE["responses"]["stop_token"]
    assert set(fixture) <= set(out)
    required = {
        "id",
        "finish_reason",
        "prompt_tokens",
        "weight_version",
        "completion_tokens",
        "cached_tokens",
        "output_token_logprobs",
    }
    assert required <= set(out["meta_info"])
    pairs = out["meta_info"]["output_token_logprobs"]
    assert [p[1] for p in pairs] == out["output_ids"] and all(
        isinstance(p[0], float) and p[2] is None for p in pairs
    )
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert out["meta_info"]["prompt_tokens"] == len(request["input_ids"])


async def test_bad_input_is_a_400_in_sglangs_error_shape(served) -> None:
    url, _ = served
    async with httpx.AsyncClient() as client:
        r = await client.post(f"{url}/generate", json={"input_ids": [10**9], "sampling_params": {}})
        both = await client.post(f"{url}/generate", json={"input_ids": [1], "text": "hi"})
    # SGLang 0.5.23: a refused request is {"error": {"message"}}, a malformed body ErrorResponse
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    assert (
        both.status_code == 400
        and both.json()["object"] == "error"
        and "cannot be provided at the same time" in both.json()["message"]
    )
    http = SGLangEngine(url, max_retries=3)
    with pytest.raises(EngineError, match="HTTP 400 \\(not retried\\)"):
        await http.generate([10**9], SamplingParams())
    await http.close()


async def test_pause_holds_requests_and_abort_returns_them_as_abort(served) -> None:
    url, _ = served
    http = SGLangEngine(url)
    await http.pause_generation()
    waiting = [asyncio.create_task(http.generate(p, seeded(i))) for i, p in enumerate(PROMPTS)]
    while await http.num_requests() < len(PROMPTS):
        await asyncio.sleep(0.02)
    await http.abort(poll_interval_s=0.02)
    results = await asyncio.gather(*waiting)
    assert all(c.finish_reason is FinishReason.ABORT for c in results)
    await http.continue_generation()
    assert await http.num_requests() == 0
    assert (await http.generate(PROMPTS[0], seeded(0))).finish_reason is not FinishReason.ABORT
    await http.close()


async def test_abort_of_running_generation_drains_the_server(served) -> None:
    url, engine = served
    http = SGLangEngine(url)
    long = SamplingParams(temperature=1.0, max_new_tokens=4000, seed=3)
    running = [asyncio.create_task(http.generate(PROMPTS[0], long)) for _ in range(2)]
    while engine.stats.num_decode_steps == 0 or await http.num_requests() < 2:
        await asyncio.sleep(0.02)
    await http.abort(poll_interval_s=0.02)
    assert all(c.finish_reason is FinishReason.ABORT for c in await asyncio.gather(*running))
    assert await http.num_requests() == 0
    await http.close()


async def test_release_memory_refuses_generation_until_resumed(served) -> None:
    url, _ = served
    http = SGLangEngine(url)
    await http.release_memory()
    with pytest.raises(EngineError, match="resume_memory_occupation"):
        await http.generate(PROMPTS[0], seeded(0))
    assert await http.health() is False
    await http.resume_memory()
    assert await http.health() is True
    assert (await http.generate(PROMPTS[0], seeded(0))).ids
    await http.close()


async def test_info_endpoints(served) -> None:
    url, engine = served
    http = SGLangEngine(url)
    info = await http.get_model_info()
    assert {"model_path", "tokenizer_path", "is_generation", "weight_version"} <= set(info)
    server = await http.get_server_info()
    assert server["tp_size"] == 1
    # On the CPU nothing is pausable: a release frees and a resume re-allocates.
    assert server["internal_states"][0]["pausable_memory"] is False
    assert server["internal_states"][0]["last_resume_s"] == {}  # nothing resumed yet
    assert server["internal_states"][0]["kv_cache_bytes"] == engine.arena.nbytes > 0
    assert server["internal_states"][0]["reserve_bytes"] == 0  # no trainer shares this engine
    assert await http.health()
    await http.flush_cache()
    await http.close()


def test_official_openai_client_chats_with_agentrl_serve(served) -> None:
    openai = pytest.importorskip("openai")
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is 2+2?"}],
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    choice = chat.choices[0]
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    token_ids = choice.model_extra["token_ids"]
    assert len(choice.logprobs.content) == len(token_ids) == chat.usage.completion_tokens
    assert all(item.logprob <= 0 for item in choice.logprobs.content)
    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0.0, logprobs=1
    )
    assert len(completion.choices[0].logprobs.token_logprobs) == completion.usage.completion_tokens
    assert completion.usage.prompt_tokens > 0


def _trajectory_key(t) -> tuple:
    return (t.token_ids, t.loss_mask, t.logprobs, t.status, t.status_reason, t.reward, t.prompt_len)


async def _rollouts(engine, codec, *, temperature: float, max_concurrent_episodes: int):
    from agentrl.config import RolloutConfig
    from agentrl.envs.builtin.calculator import CalculatorEnv
    from agentrl.rollout import RolloutRunner

    cfg = RolloutConfig(
        rollout_max_response_len=12,
        max_turns=2,
        max_concurrent_episodes=max_concurrent_episodes,
        seed=5,
    )
    runner = RolloutRunner(engine, CalculatorEnv, cfg, codec=codec)
    tasks = CalculatorEnv.load_tasks("train", num_tasks=2)
    groups = await runner.run_groups(tasks, 2, temperature=temperature)
    return [t for group in groups for t in group]


@pytest.mark.slow
async def test_rollout_and_eval_through_http_give_the_in_process_trajectories(
    served, local
) -> None:
    from agentrl.rollout import ChatCodec

    url, _ = served
    http = SGLangEngine(url)
    codec = ChatCodec(local.tokenizer, tool_call_format="hermes")
    for temperature in (1.0, 0.0):  # a training rollout, then an eval-like greedy pass
        want = await _rollouts(local, codec, temperature=temperature, max_concurrent_episodes=1)
        got = await _rollouts(http, codec, temperature=temperature, max_concurrent_episodes=1)
        assert [_trajectory_key(t) for t in got] == [_trajectory_key(t) for t in want]
        assert all(sum(t.loss_mask) > 0 for t in got)
    # Concurrent episodes batch differently on each side: same ids and masks, logprobs to 1e-4.
    want = await _rollouts(local, codec, temperature=1.0, max_concurrent_episodes=4)
    got = await _rollouts(http, codec, temperature=1.0, max_concurrent_episodes=4)
    assert [(t.token_ids, t.loss_mask) for t in got] == [(t.token_ids, t.loss_mask) for t in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    await http.close()


@pytest.mark.slow
async def test_evaluate_through_http_reports_what_the_in_process_engine_reports(
    served, local, tmp_path
) -> None:
    from agentrl.config import RolloutConfig
    from agentrl.envs.builtin.calculator import CalculatorEnv
    from agentrl.eval.runner import TRAJECTORIES_FILE, evaluate
    from agentrl.rollout import ChatCodec, RolloutRunner, read_jsonl

    url, _ = served
    http = SGLangEngine(url)
    codec = ChatCodec(local.tokenizer, tool_call_format="hermes")
    cfg = RolloutConfig(rollout_max_response_len=12, max_turns=2, max_concurrent_episodes=1)
    tasks = CalculatorEnv.load_tasks("test", num_tasks=2)
    reports, saved = [], []
    for name, engine in (("local", local), ("http", http)):
        runner = RolloutRunner(engine, CalculatorEnv, cfg, codec=codec)
        out = tmp_path / name
        reports.append(
            await evaluate(runner, tasks, k=1, temperature=0.0, out_dir=out, progress=False)
        )
        saved.append(
            sorted((_trajectory_key(t) for t in read_jsonl(out / TRAJECTORIES_FILE)), key=repr)
        )
    assert saved[0] == saved[1] and len(saved[0]) == 2
    assert (
        reports[0].reward == reports[1].reward
        and reports[0].status_counts == reports[1].status_counts
    )
    await http.close()


async def test_control_and_weight_responses_have_sglangs_shapes(served) -> None:
    url, _ = served
    control = json.loads((FIXTURES / "sglang_control.json").read_text())
    weights = json.loads((FIXTURES / "sglang_weights.json").read_text())
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.post("/pause_generation", json={})).json() == control[
            "pause_generation"
        ]["response"]
        assert (await client.post("/continue_generation", json={})).json() == control[
            "continue_generation"
        ]["response"]
        assert (await client.get("/flush_cache")).text == control["flush_cache"]["response_text"]
        release = await client.post(
            "/release_memory_occupation", json=control["release_memory_occupation"]["request"]
        )
        resume = [
            await client.post("/resume_memory_occupation", json=control[key]["request"])
            for key in ("resume_memory_occupation_weights", "resume_memory_occupation_rest")
        ]
        assert release.json() is None and all(
            r.status_code == 200 and r.json() is None for r in resume
        )
        assert (await client.get("/get_weight_version")).status_code == 404  # gone in 0.5.23
        model_info = (await client.get("/model_info")).json()
        assert set(model_info) >= set(control["get_model_info"]["response"])
        assert (await client.get("/get_model_info")).json() == model_info  # deprecated alias
        bad_disk = await client.post("/update_weights_from_disk", json={"model_path": "/nope"})
        assert bad_disk.status_code == 400 and set(bad_disk.json()) == set(
            weights["failure_response"]
        )
        assert bad_disk.json()["success"] is False and "/nope" in bad_disk.json()["message"]
        distributed = weights["update_weights_from_distributed"]["request"]
        outside = await client.post("/update_weights_from_distributed", json=distributed)
        assert outside.status_code == 400 and outside.json()["message"] == (
            "update_weights_from_distributed must run between begin_weight_update() and "
            "end_weight_update()"
        )
        assert (await client.post("/begin_weight_update", json={})).json()["success"] is True
        again = await client.post("/begin_weight_update", json={})
        assert again.status_code == 400 and "already open" in again.json()["message"]
        no_group = await client.post("/update_weights_from_distributed", json=distributed)
        assert (
            no_group.status_code == 400
            and "init_weights_update_group first" in no_group.json()["message"]
        )
        assert (await client.post("/end_weight_update", json={})).status_code == 200
        closed = await client.post("/end_weight_update", json={})
        assert closed.status_code == 400 and "no weight-update session" in closed.json()["message"]
        abort = await client.post("/abort_request", json=control["abort_request"]["request"])
        assert abort.status_code == control["abort_request"]["response_status"]


async def test_make_engine_kind_http_talks_to_agentrl_serve(served, local) -> None:
    from agentrl.config import RunConfig
    from agentrl.engine.factory import make_engine

    url, _ = served
    cfg = RunConfig()
    cfg.engine.kind, cfg.engine.url, cfg.engine.max_retries = "http", url, 1
    engine = make_engine(cfg)
    assert isinstance(engine, SGLangEngine) and engine.http.max_retries == 1
    want, got = await both(local, engine, seeded(3), PROMPTS[3])
    assert got.ids == want.ids and got.logprobs == want.logprobs
    await engine.close()
