"""The engine's fused forward (one q/k/v and one gate/up product per layer): exact against
transformers, weights that stay the model's own parameters (updates, release with dropped weights),
param_storage laying fused members back to back, and the compiled pieces equal to eager."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.engine.base import SamplingParams
from agentrl.engine.local import LocalEngine, LocalEngineOptions
from agentrl.engine.local.fused_model import (
    FusedDecoder,
    _Fused,
    attention_inputs,
    stored_layout,
    unsupported_reason,
)
from agentrl.engine.local.param_storage import pack_parameters
from agentrl.engine.local.sampling import SamplingRows, sample, vocab_terms
from tests.engine.local.test_local import teacher_forced_logprobs

PROMPTS = [list(range(100, 100 + n)) for n in (3, 41, 12)]
SAMPLED = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, max_new_tokens=16, seed=3)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


def fused_engine(model_or_path, tokenizer=None, **options) -> LocalEngine:
    options = {"fuse_projections": True, "max_batch_size": 8, **options}
    if isinstance(model_or_path, str):
        return LocalEngine.load(model_or_path, device="cpu", dtype="float32", **options)
    return LocalEngine(model_or_path, tokenizer, LocalEngineOptions(**options))


async def generate_all(engine: LocalEngine, sampling: SamplingParams):
    return await asyncio.gather(*[engine.generate(p, sampling) for p in PROMPTS])


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED])
async def test_fused_logprobs_equal_a_teacher_forced_pass_and_greedy_equals_unfused(
    tiny_model_path: str, sampling: SamplingParams
) -> None:
    fused, plain = (
        fused_engine(tiny_model_path),
        fused_engine(tiny_model_path, fuse_projections=False),
    )
    assert fused.fused is not None and plain.fused is None
    results = await generate_all(fused, sampling)
    for prompt, c in zip(PROMPTS, results, strict=True):
        expected = teacher_forced_logprobs(
            fused.model, prompt, c.ids, sampling.temperature, sampling.top_k, sampling.top_p
        )
        assert (torch.tensor(c.logprobs) - expected).abs().mean() <= 1e-4
    if sampling.temperature == 0:
        assert [c.ids for c in await generate_all(plain, sampling)] == [c.ids for c in results]
    await fused.close()
    await plain.close()


async def test_fused_weights_are_the_parameters_viewed_together(tiny_model_path: str) -> None:
    engine = fused_engine(tiny_model_path)
    attn = engine.model.model.layers[1].self_attn
    layer = engine.fused.layers[1]
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert layer.qkv.weight.data_ptr() == q.data_ptr()  # a view, not a copy
    assert torch.equal(layer.qkv.weight, torch.cat([q, k, v]))
    with torch.no_grad():
        v.mul_(2.0)  # what update_weights does: copy into the parameter in place
    assert torch.equal(layer.qkv.weight[-v.shape[0] :], v)
    await engine.close()


async def test_weight_update_matches_a_fresh_engine_on_the_new_weights(
    tiny_model_path: str,
) -> None:
    engine = fused_engine(tiny_model_path)
    before = await generate_all(engine, SAMPLED)
    g = torch.Generator().manual_seed(1)
    new = {
        n: t + 0.05 * torch.randn(t.shape, generator=g)
        for n, t in engine.model.state_dict().items()
    }
    await engine.update_weights(list(new.items()), weight_version=1)
    updated = await generate_all(engine, SAMPLED)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    model.load_state_dict(new)
    fresh = fused_engine(model, AutoTokenizer.from_pretrained(tiny_model_path))
    expected = await generate_all(fresh, SAMPLED)
    assert [c.ids for c in updated] == [c.ids for c in expected]
    assert [c.logprobs for c in updated] == [c.logprobs for c in expected]  # bit for bit
    assert [c.ids for c in updated] != [c.ids for c in before]
    await engine.close()
    await fresh.close()


async def test_dropped_weights_are_fused_again_on_resume(tiny_model_path: str) -> None:
    """A colocated release that drops the weights (no host copy) re-allocates them back to back;
    once every weight is sent again the engine answers as before (the release path runs on CPU
    here through the engine's own commands)."""
    engine = fused_engine(tiny_model_path, weights_cpu_backup=False)
    before = await generate_all(engine, GREEDY)
    weights = [(n, t.detach().clone()) for n, t in engine.model.state_dict().items()]
    await engine._call(lambda: engine._release(False))
    assert engine.fused.layers[0].qkv.weight is None  # nothing holds the old storage
    await engine._call(lambda: engine._resume({"weights", "kv_cache"}))
    layer = engine.fused.layers[0]
    assert (
        layer.qkv.weight.data_ptr()
        == engine.model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    )
    await engine.update_weights(weights, weight_version=1)
    assert [c.ids for c in await generate_all(engine, GREEDY)] == [c.ids for c in before]
    await engine.close()


def test_packing_lays_fused_members_back_to_back(tiny_model_path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    decoder = FusedDecoder(model)  # binds by copying: loaded weights are separate tensors
    pack_parameters(model, "cpu", decoder.groups)
    fused = decoder.layers[0].qkv
    assert fused.bind() is False  # adjacent after packing: a view, no copy
    # Members whose sizes are not a multiple of the 256-byte alignment still come out adjacent.
    odd = [torch.nn.Parameter(torch.randn(3, 5)) for _ in range(3)]
    values = [p.detach().clone() for p in odd]
    holder = torch.nn.ParameterList(odd)
    pack_parameters(holder, "cpu", [odd])
    group = _Fused(list(odd))
    assert group.bind() is False and torch.equal(group.weight, torch.cat(values))


def test_models_outside_the_llama_family_are_refused(tiny_model_path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    other = copy.deepcopy(model)
    other.config.model_type = "gpt_neox"
    assert "gpt_neox" in (unsupported_reason(other) or "")
    with pytest.raises(ValueError, match="fuse_projections=False"):
        options = LocalEngineOptions(fuse_projections=True)
        LocalEngine(other, AutoTokenizer.from_pretrained(tiny_model_path), options)
    assert unsupported_reason(model) is None


@pytest.mark.slow
async def test_compiled_pieces_equal_eager(tiny_model_path: str) -> None:
    """torch.compile (inductor's C++ backend here; Triton on CUDA) traces the fused forward and
    the sampler whole (its radix-select filter too), and gives the eager results."""
    results = {}
    for compiled in (False, True):
        engine = fused_engine(tiny_model_path)
        engine.fused.set_compiled(compiled)
        results[compiled] = await generate_all(engine, SAMPLED)
        assert engine.fused.is_compiled == compiled  # no fallback to eager
        await engine.close()
    for eager, comp in zip(results[False], results[True], strict=True):
        assert comp.ids == eager.ids
        assert max(abs(a - b) for a, b in zip(comp.logprobs, eager.logprobs, strict=True)) <= 1e-5
    logits = torch.randn(4, 1000)
    rows = SamplingRows.empty(4, "cpu")
    rows.fill([(1.0, 0.9, 20, 7, 3), (0.0, 1.0, -1, 1, 0), (0.7, 1.0, -1, 2, 5),
               (1.3, 0.5, 100, 3, 1)], 1000)  # fmt: skip
    compiled_sample = torch.compile(sample, fullgraph=True)
    for use_filter in (True, False):
        want = sample(logits, rows, use_filter=use_filter)
        got = compiled_sample(
            logits, rows, use_filter=use_filter, terms=vocab_terms(1000, "cpu"), radix_filter=True
        )  # as the compiled decode graphs sample: top-k/top-p by radix select
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
async def test_head_major_arena_gives_the_row_major_results(
    tiny_model_path: str, compiled: bool
) -> None:
    """The arena as CUDA lays it out for FlashAttention (each head's rows contiguous, seen through
    strides), run here on the SDPA path: the same tokens and logprobs as the row-major arena, the
    K/V written in place through the strides (compiled: inside inductor's kernel)."""
    results = {}
    for head_major in (False, True):
        engine = fused_engine(tiny_model_path)
        engine.fused.set_compiled(compiled)
        engine.arena.allocate("cpu", head_major=head_major)  # before any request holds a slot
        keys = engine.arena.keys[0].zero_()  # allocated empty: unwritten rows may hold NaN
        assert keys.shape[1:] == (engine.arena.num_kv_heads, engine.arena.head_dim)
        assert (keys.stride(1) > keys.stride(0)) == head_major
        results[head_major] = await generate_all(engine, SAMPLED)
        assert engine.fused.is_compiled == compiled  # no fallback to eager
        assert engine.arena.keys[0].data_ptr() == keys.data_ptr() and keys.abs().sum() > 0
        await engine.close()
    for row_major, head_major in zip(results[False], results[True], strict=True):
        assert head_major.ids == row_major.ids
        assert head_major.logprobs == pytest.approx(row_major.logprobs, abs=1e-5)


@pytest.mark.slow
def test_compiled_attention_inputs_write_only_the_new_rows_of_a_head_major_arena() -> None:
    """Written through the head-major view ([KVH, rows, D] seen as [rows, KVH, D]), inductor
    copied the whole buffer onto itself on every call: on an H100 a 1.7B model at batch 64 moved
    10 GB a decode step that way. In its stored layout only the step's rows are written."""
    from torch._inductor.utils import run_and_get_code

    rows, kv_heads, heads, head_dim, hidden_size, n = 4096, 2, 4, 16, 64, 8
    buffers = [torch.zeros(kv_heads, rows, head_dim).permute(1, 0, 2) for _ in range(2)]
    (keys, head_major), (values, _) = map(stored_layout, buffers)
    assert head_major and keys.is_contiguous()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, hidden_size, generator=g)
    weight = torch.randn((heads + 2 * kv_heads) * head_dim, hidden_size, generator=g)
    cos, sin = torch.randn(n, 1, head_dim, generator=g), torch.randn(n, 1, head_dim, generator=g)
    index = torch.arange(n) * 3
    args = (hidden, torch.ones(hidden_size), 1e-6, weight, None, cos, sin, heads, kv_heads)
    with torch.inference_mode():
        (q, k, v), code = run_and_get_code(
            torch.compile(attention_inputs, fullgraph=True), *args, keys, values, index, head_major
        )
    assert code and str(rows * kv_heads * head_dim) not in "\n".join(code)  # no whole-buffer loop
    assert torch.equal(buffers[0][index], k) and torch.equal(buffers[1][index], v)
    assert buffers[0].abs().sum() == k.abs().sum()  # nothing else written


async def test_a_failing_compile_falls_back_to_eager(tiny_model_path: str) -> None:
    """A compiled piece that raises (no compiler, an op inductor cannot generate) turns compilation
    off and the step runs eagerly with the same results; running out of memory is not a compile
    failure and keeps compilation on."""
    eager = fused_engine(tiny_model_path)
    want = await generate_all(eager, GREEDY)
    await eager.close()
    engine = fused_engine(tiny_model_path)
    engine.fused.set_compiled(True)

    def broken(*args, **kwargs):
        raise RuntimeError("inductor: cannot generate code")

    engine.fused._attention_inputs = broken
    got = await generate_all(engine, GREEDY)
    assert not engine.fused.is_compiled
    assert [c.ids for c in got] == [c.ids for c in want]
    engine.fused.set_compiled(True)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    engine.fused._attention_inputs = out_of_memory
    with pytest.raises(Exception, match="out of memory"):
        await engine.generate(PROMPTS[0], GREEDY)
    assert engine.fused.is_compiled
    await engine.close()
