"""LocalEngine: batching invariance, exact logprobs, finish reasons, seeds, weight updates, abort."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from agentrl.config import EngineConfig, ModelConfig
from agentrl.engine.base import Engine, EngineError, FinishReason, SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.engine.local.sampling import filter_top_k_top_p

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
PROMPTS = [list(range(100, 100 + n)) for n in (3, 41, 12, 27, 7)]


@pytest.fixture(scope="module")
def engine(tiny_model_path: str) -> Iterator[LocalEngine]:
    eng = LocalEngine.load(tiny_model_path, device="cpu", dtype="float32", max_batch_size=8)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture
def fresh_engine(tiny_model_path: str) -> Iterator[LocalEngine]:
    """An engine a test may change (weights, abort) without affecting the others."""
    eng = LocalEngine.load(tiny_model_path, device="cpu", dtype="float32", max_batch_size=8)
    yield eng
    asyncio.run(eng.close())


def teacher_forced_logprobs(
    model: torch.nn.Module,
    prompt: list[int],
    ids: list[int],
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Logprobs of `ids` after `prompt` under softmax(logits / T), top-k/top-p applied and
    renormalised as the sampler does."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = (
            (model(torch.tensor([prompt + ids], device=device)).logits[0, len(prompt) - 1 : -1])
            .float()
            .cpu()
        )  # [N, V]
    t = temperature if temperature > 0 else 1.0
    n = len(ids)
    k = torch.full((n,), top_k if top_k > 0 else logits.shape[-1])
    scaled = filter_top_k_top_p(logits / t, k, torch.full((n,), top_p))
    return torch.log_softmax(scaled, dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]


def assert_bf16_teacher_forced(logprobs: list[float], expected: torch.Tensor) -> None:
    """bf16 logprobs against teacher forcing within bf16's 2e-2 on average. Under top-k/top-p a
    random model's flat logits put near-ties at the filter's edge, which bf16 rounding of two
    differently fused computations may keep on one side and not the other: a sampled token the
    teacher's filter drops (-inf) is allowed for one token in eight, and the rest must agree."""
    kept = expected.isfinite()
    assert kept.float().mean() >= 7 / 8
    assert (torch.tensor(logprobs)[kept] - expected[kept]).abs().mean() <= 2e-2


def test_implements_engine_protocol(engine: LocalEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.weight_version == 0


async def test_greedy_ids_do_not_depend_on_batch_mates(engine: LocalEngine) -> None:
    alone = [await engine.generate(p, GREEDY) for p in PROMPTS]
    together = await asyncio.gather(*[engine.generate(p, GREEDY) for p in PROMPTS])
    for a, b in zip(alone, together, strict=True):
        assert a.ids == b.ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
        assert b.prompt_tokens in {len(p) for p in PROMPTS}


async def test_request_joining_a_running_batch_matches_running_alone(engine: LocalEngine) -> None:
    long_params = SamplingParams(temperature=0.0, max_new_tokens=80)
    first = asyncio.ensure_future(engine.generate(PROMPTS[0], long_params))
    steps_before = engine.stats.num_decode_steps
    while engine.stats.num_decode_steps < steps_before + 5:
        await asyncio.sleep(0.001)
    joined = await engine.generate(PROMPTS[1], GREEDY)
    assert not first.done()  # it really joined mid-decode, not after
    first_result = await first
    assert joined.ids == (await engine.generate(PROMPTS[1], GREEDY)).ids
    assert first_result.ids == (await engine.generate(PROMPTS[0], long_params)).ids


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.0, max_new_tokens=16),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=16, seed=1),
        SamplingParams(temperature=1.3, max_new_tokens=16, seed=2),
    ],
)
async def test_logprobs_equal_a_teacher_forced_pass(
    engine: LocalEngine, sampling: SamplingParams
) -> None:
    results = await asyncio.gather(*[engine.generate(p, sampling) for p in PROMPTS[:3]])
    for prompt, c in zip(PROMPTS[:3], results, strict=True):
        expected = teacher_forced_logprobs(
            engine.model, prompt, c.ids, sampling.temperature, sampling.top_k, sampling.top_p
        )
        assert len(c.ids) == len(c.logprobs) == 16
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=1.0, top_k=1, max_new_tokens=12, seed=5),
        SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=12, seed=5),
    ],
)
async def test_top_k_1_and_tiny_top_p_reduce_to_greedy(
    engine: LocalEngine, sampling: SamplingParams
) -> None:
    greedy = await engine.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=12))
    sampled = await engine.generate(PROMPTS[1], sampling)
    assert sampled.ids == greedy.ids
    # The logprobs are of the distribution sampled from: one token is left, log 1 each.
    assert sampled.is_logprob_truncated and not greedy.is_logprob_truncated
    assert torch.allclose(torch.tensor(sampled.logprobs), torch.zeros(12), atol=1e-5)


async def test_seeded_sampling_ignores_batch_composition(engine: LocalEngine) -> None:
    seeded = SamplingParams(temperature=1.0, max_new_tokens=20, seed=1234)
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=30)
    alone = await engine.generate(PROMPTS[2], seeded)
    crowd = [engine.generate(p, unseeded) for p in PROMPTS]
    in_batch, *_ = await asyncio.gather(engine.generate(PROMPTS[2], seeded), *crowd)
    assert in_batch.ids == alone.ids
    other_seed = await engine.generate(
        PROMPTS[2], SamplingParams(temperature=1.0, max_new_tokens=20, seed=99)
    )
    assert other_seed.ids != alone.ids


async def test_length_finish(engine: LocalEngine) -> None:
    c = await engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=5))
    assert (len(c.ids), c.finish_reason, c.matched_stop) == (5, FinishReason.LENGTH, None)
    empty = await engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=0))
    assert (empty.ids, empty.finish_reason) == ([], FinishReason.LENGTH)


async def test_stop_token_id_is_kept_and_reported(engine: LocalEngine) -> None:
    reference = await engine.generate(PROMPTS[3], GREEDY)
    stop_id = reference.ids[4]
    cut = reference.ids.index(stop_id) + 1
    c = await engine.generate(
        PROMPTS[3], SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=[stop_id])
    )
    assert c.ids == reference.ids[:cut]
    assert (c.finish_reason, c.matched_stop) == (FinishReason.STOP, stop_id)


async def test_stop_string_ends_on_the_completing_token(engine: LocalEngine) -> None:
    tok = engine.tokenizer
    reference = await engine.generate(PROMPTS[4], GREEDY)
    text = tok.decode(reference.ids[3:6])
    stop = text[len(text) // 2 :] or text  # may start inside a token
    cut = next(k for k in range(1, len(reference.ids) + 1) if stop in tok.decode(reference.ids[:k]))
    c = await engine.generate(
        PROMPTS[4], SamplingParams(temperature=0.0, max_new_tokens=24, stop=["\x00never", stop])
    )
    assert c.ids == reference.ids[:cut]
    assert (c.finish_reason, c.matched_stop) == (FinishReason.STOP, stop)
    assert stop in tok.decode(c.ids)


async def test_eos_from_generation_config_stops_and_is_included(
    tiny_model_path: str, tmp_path: Path
) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_path, model_dir)
    probe = LocalEngine.load(str(model_dir), device="cpu")
    reference = await probe.generate(PROMPTS[1], GREEDY)
    await probe.close()
    eos_id = reference.ids[2]
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [2, eos_id]
    config_path.write_text(json.dumps(config))
    eng = LocalEngine.load(str(model_dir), device="cpu")
    c = await eng.generate(PROMPTS[1], GREEDY)
    await eng.close()
    assert c.ids == reference.ids[: reference.ids.index(eos_id) + 1]
    assert (c.finish_reason, c.matched_stop) == (FinishReason.STOP, eos_id)


async def test_concurrent_requests_share_decode_steps(tiny_model_path: str) -> None:
    eng = LocalEngine.load(tiny_model_path, device="cpu", max_batch_size=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    results = await asyncio.gather(*[eng.generate(PROMPTS[i % 5], params) for i in range(10)])
    await eng.close()
    assert all(len(r.ids) == 20 for r in results)
    assert 1 < eng.stats.max_running_batch_size <= 4
    # Served one by one, 10 requests of 20 tokens would take 10 * 19 decode steps.
    assert eng.stats.num_decode_steps < 10 * 19


async def test_update_weights_changes_outputs_and_version(fresh_engine: LocalEngine) -> None:
    before = await fresh_engine.generate(PROMPTS[1], GREEDY)
    generator = torch.Generator().manual_seed(0)
    new = [
        (n, torch.randn(p.shape, generator=generator) * 0.5)
        for n, p in fresh_engine.model.state_dict().items()
    ]
    await fresh_engine.update_weights(new, weight_version=7)
    after = await fresh_engine.generate(PROMPTS[1], GREEDY)
    assert fresh_engine.weight_version == after.weight_version == 7
    assert before.weight_version == 0
    assert after.ids != before.ids
    name, tensor = next((n, t) for n, t in new if n == "model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(fresh_engine.model.state_dict()[name], tensor)


async def test_update_weights_during_generation_applies_between_steps(
    fresh_engine: LocalEngine,
) -> None:
    running = asyncio.ensure_future(
        fresh_engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=300))
    )
    while fresh_engine.stats.num_decode_steps < 3:
        await asyncio.sleep(0.001)
    state = fresh_engine.model.state_dict()
    await fresh_engine.update_weights(
        [(n, t.clone() * 1.01) for n, t in state.items()], weight_version=1
    )
    c = await running
    assert (len(c.ids), c.weight_version) == (300, 1)
    # Each token keeps the version that sampled it: a stale token must not pass as fresh.
    [(old, num_old), (new, num_new)] = c.version_spans
    assert (old, new) == (0, 1) and num_old >= 3 and num_old + num_new == 300


async def test_update_weights_rejects_unknown_name_and_bad_shape(fresh_engine: LocalEngine) -> None:
    with pytest.raises(ValueError, match="'model.no_such.weight'"):
        await fresh_engine.update_weights(
            [("model.no_such.weight", torch.zeros(1))], weight_version=1
        )
    name = "model.embed_tokens.weight"
    with pytest.raises(ValueError, match="shape"):
        await fresh_engine.update_weights([(name, torch.zeros(3, 3))], weight_version=1)
    assert fresh_engine.weight_version == 0


async def test_abort_returns_partial_ids_and_engine_keeps_serving(
    fresh_engine: LocalEngine,
) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=5000)
    running = [asyncio.ensure_future(fresh_engine.generate(p, params)) for p in PROMPTS[:3]]
    while fresh_engine.stats.num_decode_steps < 5:
        await asyncio.sleep(0.001)
    await fresh_engine.abort()
    for c in await asyncio.gather(*running):
        assert c.finish_reason == FinishReason.ABORT
        assert 0 < len(c.ids) < 5000 and len(c.logprobs) == len(c.ids)
    after = await fresh_engine.generate(
        PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=4)
    )
    assert after.finish_reason == FinishReason.LENGTH


async def test_cancelled_request_leaves_the_batch(fresh_engine: LocalEngine) -> None:
    task = asyncio.ensure_future(
        fresh_engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=5000))
    )
    while fresh_engine.stats.num_decode_steps < 3:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    c = await fresh_engine.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert len(c.ids) == 4
    assert fresh_engine.stats.num_generated_tokens < 1000


@pytest.mark.parametrize(
    ("ids", "sampling", "match"),
    [
        ([], GREEDY, "input_ids is empty"),
        ([10**9], GREEDY, "outside the vocabulary"),
        ([5], SamplingParams(temperature=-1.0), "temperature=-1.0"),
        ([5], SamplingParams(top_p=0.0), "top_p=0.0"),
        ([5], SamplingParams(top_k=0), "top_k=0"),
    ],
)
async def test_bad_requests_name_the_field(
    engine: LocalEngine, ids: list[int], sampling: SamplingParams, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        await engine.generate(ids, sampling)


async def test_release_resume_is_a_noop_on_cpu(engine: LocalEngine) -> None:
    await engine.release_memory()
    await engine.resume_memory()
    assert await engine.health()
    assert len((await engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=3))).ids) == 3


async def test_close_stops_the_worker(tiny_model_path: str) -> None:
    eng = LocalEngine.load(tiny_model_path, device="cpu")
    await eng.close()
    assert not await eng.health()
    with pytest.raises(EngineError, match="closed"):
        await eng.generate(PROMPTS[0], GREEDY)


async def test_from_config_and_bfloat16(tiny_model_path: str) -> None:
    eng = LocalEngine.from_config(
        ModelConfig(path=tiny_model_path, device="cpu", dtype="bfloat16"),
        EngineConfig(max_batch_size=3),
    )
    c = await eng.generate(PROMPTS[1], SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    await eng.close()
    assert eng.model.dtype == torch.bfloat16 and eng.max_batch_size == 3
    assert len(c.ids) == 8 and all(lp <= 0.0 for lp in c.logprobs)


@pytest.mark.slow
async def test_smollm2_answers_and_stops_at_eos(smollm2_path: str) -> None:
    eng = LocalEngine.load(smollm2_path, device="cpu", max_batch_size=4)
    tok = eng.tokenizer
    questions = ["What is the capital of France?", "What is 2+3?", "Say hello."]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in questions
    ]
    prompts = [
        list(p["input_ids"]) if hasattr(p, "keys") else p for p in prompts
    ]  # transformers 5 returns a dict
    results = await asyncio.gather(
        *[eng.generate(p, SamplingParams(temperature=0.0, max_new_tokens=48)) for p in prompts]
    )
    await eng.close()
    assert "Paris" in tok.decode(results[0].ids)
    for prompt, c in zip(prompts, results, strict=True):
        assert (c.finish_reason, c.matched_stop, c.ids[-1]) == (
            FinishReason.STOP,
            tok.eos_token_id,
            tok.eos_token_id,
        )
        reference = eng.model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)[
            0, len(prompt) :
        ]
        assert c.ids == reference.tolist()


# ---------------------------------------------------------------------- multi-turn prefix reuse


def next_turn(prompt: list[int], reply: list[int], turn: int) -> list[int]:
    """The episode's next input: history + the reply + a 9-token observation."""
    return prompt + reply + list(range(300 + 10 * turn, 309 + 10 * turn))


async def test_turns_reuse_their_prefix_and_match_a_full_prefill(engine: LocalEngine) -> None:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=12)
    ids, key = list(PROMPTS[3]), "episode-reuse"
    expected_cached = 0  # turn 1 prefills everything
    for turn in range(3):
        c = await engine.generate(ids, sampling, routing_key=key)
        full = await engine.generate(ids, sampling)  # no key: prefills the whole input
        assert c.ids == full.ids
        assert max(abs(a - b) for a, b in zip(c.logprobs, full.logprobs, strict=True)) < 1e-4
        expected = teacher_forced_logprobs(engine.model, ids, c.ids, 0.0)
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)
        assert (c.cached_tokens, full.cached_tokens) == (expected_cached, 0)
        # The next turn prefills only the reply's last token (never fed back) + the observation.
        expected_cached = len(ids) + len(c.ids) - 1
        ids = next_turn(ids, c.ids, turn)


async def test_sampled_turns_reuse_prefix_and_logprobs_stay_exact(engine: LocalEngine) -> None:
    sampling = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=10, seed=11)
    ids, key = list(PROMPTS[1]), "episode-sampled"
    for turn in range(3):
        c = await engine.generate(ids, sampling, routing_key=key)
        expected = teacher_forced_logprobs(
            engine.model, ids, c.ids, sampling.temperature, top_p=sampling.top_p
        )
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)
        assert (c.cached_tokens > 0) == (turn > 0)
        ids = next_turn(ids, c.ids, turn)


async def test_a_diverging_input_reuses_only_the_common_prefix(engine: LocalEngine) -> None:
    first = await engine.generate(PROMPTS[1], GREEDY, routing_key="episode-diverge")
    edited = PROMPTS[1][:10] + [7, 8, 9] + first.ids
    c = await engine.generate(edited, GREEDY, routing_key="episode-diverge")
    assert c.cached_tokens == 10
    assert c.ids == (await engine.generate(edited, GREEDY)).ids


async def test_least_recently_used_prefix_is_evicted_under_pressure(tiny_model_path: str) -> None:
    eng = LocalEngine.load(
        tiny_model_path, device="cpu", dtype="float32", max_batch_size=1, num_slots=2
    )
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4)
    replies = {}
    for key, prompt in zip("abc", PROMPTS, strict=False):  # c takes the slot a held longest
        replies[key] = (prompt, (await eng.generate(prompt, sampling, routing_key=key)).ids)
    cached = {}
    for key in "ca":
        prompt, reply = replies[key]
        c = await eng.generate(next_turn(prompt, reply, 0), sampling, routing_key=key)
        cached[key] = c.cached_tokens
    await eng.close()
    assert cached == {"c": len(PROMPTS[2]) + 3, "a": 0}


async def test_update_weights_drops_cached_prefixes(fresh_engine: LocalEngine) -> None:
    first = await fresh_engine.generate(PROMPTS[1], GREEDY, routing_key="episode-w")
    state = fresh_engine.model.state_dict()
    await fresh_engine.update_weights(
        [(n, t.clone() * 1.01) for n, t in state.items()], weight_version=1
    )
    c = await fresh_engine.generate(
        next_turn(PROMPTS[1], first.ids, 0), GREEDY, routing_key="episode-w"
    )
    assert c.cached_tokens == 0 and c.weight_version == 1


async def test_prefix_reuse_can_be_turned_off(tiny_model_path: str) -> None:
    eng = LocalEngine.load(tiny_model_path, device="cpu", dtype="float32", use_prefix_cache=False)
    first = await eng.generate(PROMPTS[1], GREEDY, routing_key="k")
    c = await eng.generate(next_turn(PROMPTS[1], first.ids, 0), GREEDY, routing_key="k")
    await eng.close()
    assert c.cached_tokens == 0 and eng.stats.num_cached_tokens == 0


async def test_context_length_bounds_prompt_and_output(tiny_model_path: str) -> None:
    eng = LocalEngine.load(tiny_model_path, device="cpu", dtype="float32", max_context_len=48)
    too_long = await eng.generate(list(range(100, 160)), GREEDY)
    capped = await eng.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=40))
    await eng.close()
    assert (too_long.ids, too_long.finish_reason) == ([], FinishReason.LENGTH)
    assert (len(PROMPTS[1]) + len(capped.ids), capped.finish_reason) == (48, FinishReason.LENGTH)
