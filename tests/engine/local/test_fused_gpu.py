"""The fused, compiled decode path on CUDA (bf16): fused projections replayed in CUDA graphs, the
compiled graphs against eager ones, weight updates and memory release reaching the fused weights."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.engine.base import SamplingParams
from agentrl.engine.local import LocalEngine, LocalEngineOptions
from tests.engine.local.test_local import assert_bf16_teacher_forced, teacher_forced_logprobs

pytestmark = pytest.mark.gpu

PROMPTS = [list(range(100, 100 + n)) for n in (3, 41, 12, 27, 7)]
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=24, seed=4)
FILTERED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=24, seed=5)


def cuda_engine(path: str, **options) -> LocalEngine:
    return LocalEngine.load(path, device="cuda", dtype="bfloat16", max_batch_size=8, **options)


async def run_checked(engine: LocalEngine, sampling: SamplingParams) -> list:
    results = await asyncio.gather(*[engine.generate(p, sampling) for p in PROMPTS])
    for prompt, c in zip(PROMPTS, results, strict=True):
        expected = teacher_forced_logprobs(
            engine.model, prompt, c.ids, sampling.temperature, sampling.top_k, sampling.top_p
        )
        assert_bf16_teacher_forced(c.logprobs, expected)
    return results


def assert_agree(first: list, second: list) -> None:
    """Two engines' completions of the same requests: the same tokens (bf16 rounding may part
    them after a near-tie, so a long common start) and logprobs within bf16 tolerance there."""
    for one, other in zip(first, second, strict=True):
        common = next(
            (i for i, (a, b) in enumerate(zip(one.ids, other.ids, strict=True)) if a != b), 24
        )
        assert common >= 8
        diff = torch.tensor(one.logprobs[:common]) - torch.tensor(other.logprobs[:common])
        assert diff.abs().mean() <= 2e-2


@pytest.mark.parametrize("sampling", [SAMPLED, FILTERED])
async def test_fused_compiled_graphs_match_teacher_forcing(
    tiny_model_path: str, sampling: SamplingParams
) -> None:
    engine = cuda_engine(tiny_model_path)
    assert engine.fused is not None  # on by default on CUDA for a Llama
    await run_checked(engine, sampling)
    assert engine.stats.num_graph_replays > 0 and engine._stepper.graphs is not None
    assert engine.fused.is_compiled  # compiled, not fallen back to eager
    assert not engine._stepper.graphs._eager_sampling  # the sampler too (radix top-k/top-p)
    attn = engine.model.model.layers[0].self_attn
    assert engine.fused.layers[0].qkv.weight.data_ptr() == attn.q_proj.weight.data_ptr()
    await engine.close()


async def test_compiled_decode_equals_eager_decode(tiny_model_path: str) -> None:
    """Same requests through compiled and eager CUDA graphs: the same tokens (bf16 rounding may
    part them after a near-tie, so a long common start) and logprobs within bf16 tolerance."""
    outputs = {}
    for compiled in (True, False):
        engine = cuda_engine(tiny_model_path, compile_decode=compiled)
        outputs[compiled] = await run_checked(engine, SAMPLED)
        assert engine.fused.is_compiled == compiled and engine.stats.num_graph_replays > 0
        await engine.close()
    assert_agree(outputs[True], outputs[False])


async def test_split_k_decode_equals_flash_attention_decode(tiny_model_path: str) -> None:
    """The Triton split-K decode kernel (on by default where triton is installed) against torch's
    FlashAttention on the same requests: both match teacher forcing, and they agree closely."""
    outputs = {}
    for split_k in (True, False):
        engine = cuda_engine(tiny_model_path, split_k_decode=split_k)
        assert engine._stepper.options.split_k == split_k
        outputs[split_k] = await run_checked(engine, SAMPLED)
        assert engine.stats.num_graph_replays > 0
        await engine.close()
    assert_agree(outputs[True], outputs[False])


async def test_unfused_path_stays_available(tiny_model_path: str) -> None:
    engine = cuda_engine(tiny_model_path, fuse_projections=False, compile_decode=False)
    assert engine.fused is None
    await run_checked(engine, SAMPLED)
    assert engine.stats.num_graph_replays > 0
    await engine.close()


@pytest.mark.parametrize("pausable", [True, False])
async def test_weight_update_under_graphs_equals_a_fresh_engine(
    tiny_model_path: str, pausable: bool
) -> None:
    """Updates copy into the parameters, which the fused weights view: captured graphs read the
    new weights, as a fresh engine built on them does (greedy, same kernels: same ids)."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    engine = cuda_engine(tiny_model_path, pausable_memory=pausable)
    before = await run_checked(engine, greedy)
    g = torch.Generator().manual_seed(1)
    new = {n: t.float().cpu() + 0.05 * torch.randn(t.shape, generator=g)
           for n, t in engine.model.state_dict().items()}  # fmt: skip
    await engine.update_weights(list(new.items()), weight_version=1)
    await engine.release_memory()  # pages unmapped (pausable) or weights moved to the host
    await engine.resume_memory()
    updated = await run_checked(engine, greedy)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model.load_state_dict(new)
    fresh = LocalEngine(
        model.to("cuda", torch.bfloat16).eval(),
        AutoTokenizer.from_pretrained(tiny_model_path),
        LocalEngineOptions(max_batch_size=8, pausable_memory=pausable),
    )
    expected = await run_checked(fresh, greedy)
    assert [c.ids for c in updated] == [c.ids for c in expected]
    assert [c.ids for c in updated] != [c.ids for c in before]
    await engine.close()
    await fresh.close()
