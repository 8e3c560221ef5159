"""LocalEngine on CUDA: batching invariance in bf16, CUDA-graph decode against teacher forcing
across release, resume and weight updates, run-ahead decode, prefix reuse, releases without a host
copy (run by `pytest -m gpu` on the GPU machine)."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from agentrl.engine.base import EngineError, FinishReason, SamplingParams
from agentrl.engine.local import LocalEngine
from tests.engine.local.test_local import (
    GREEDY,
    PROMPTS,
    assert_bf16_teacher_forced,
    next_turn,
    teacher_forced_logprobs,
)


@pytest.mark.gpu
async def test_cuda_batching_invariance_bfloat16_and_release_memory(tiny_model_path: str) -> None:
    fp32 = LocalEngine.load(tiny_model_path, device="cuda", dtype="float32")
    alone = [await fp32.generate(p, GREEDY) for p in PROMPTS]
    together = await asyncio.gather(*[fp32.generate(p, GREEDY) for p in PROMPTS])
    await fp32.close()
    for a, b in zip(alone, together, strict=True):
        assert a.ids == b.ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3
    # Without pausable memory, release_memory keeps the weights in host memory.
    eng = LocalEngine.load(tiny_model_path, device="cuda", dtype="auto", pausable_memory=False)
    assert eng.model.dtype == torch.bfloat16
    seeded = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3)
    first = await eng.generate(PROMPTS[1], seeded)
    batch = await asyncio.gather(*[eng.generate(p, seeded) for p in PROMPTS])
    assert all(torch.isfinite(torch.tensor(c.logprobs)).all() for c in batch)
    await eng.release_memory()
    assert next(eng.model.parameters()).device.type == "cpu"
    await eng.resume_memory()
    again = await eng.generate(PROMPTS[1], seeded)
    await eng.close()
    assert first.ids == again.ids


def device_free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def pausable_modes() -> list[bool]:
    """Pausable memory (torch_memory_saver) where it is installed, and the free/re-allocate path."""
    from agentrl.engine.local.device_memory import PausableMemory

    has_saver = torch.cuda.is_available() and PausableMemory.create("cuda") is not None
    return [False, True] if has_saver else [False]


@pytest.mark.gpu
@pytest.mark.parametrize("pausable", pausable_modes())
async def test_cuda_graph_decode_bf16_matches_teacher_forcing_across_release_and_update(
    tiny_model_path: str, pausable: bool
) -> None:
    eng = LocalEngine.load(
        tiny_model_path, device="cuda", dtype="bfloat16", max_batch_size=8,
        pausable_memory=pausable,
    )  # fmt: skip
    assert eng.is_memory_pausable == pausable
    sampling = SamplingParams(temperature=1.0, top_k=40, max_new_tokens=24, seed=4)

    async def run_and_check() -> list[int]:
        results = await asyncio.gather(*[eng.generate(p, sampling) for p in PROMPTS])
        for prompt, c in zip(PROMPTS, results, strict=True):
            expected = teacher_forced_logprobs(
                eng.model, prompt, c.ids, sampling.temperature, sampling.top_k, sampling.top_p
            )
            assert_bf16_teacher_forced(c.logprobs, expected)
        return (await eng.generate(PROMPTS[1], sampling)).ids  # alone: a deterministic layout

    first = await run_and_check()
    assert eng.stats.num_graph_replays > 0
    before = device_free_bytes()
    held = eng.arena.nbytes + sum(p.numel() * p.element_size() for p in eng.model.parameters())
    engine_held = eng.device_memory_bytes()
    await eng.release_memory()
    assert device_free_bytes() - before >= held  # weights and KV arena given back to the device
    assert eng.device_memory_bytes() <= engine_held - held  # and the engine reports them gone
    await eng.resume_memory()
    replays = eng.stats.num_graph_replays
    assert await run_and_check() == first  # same seeded draws on the resumed memory
    assert eng.stats.num_graph_replays > replays
    state = eng.model.state_dict()
    await eng.update_weights([(n, t * 1.05) for n, t in state.items()], weight_version=2)
    assert await run_and_check() != first  # the graphs read the new weights in place
    await eng.close()


@pytest.mark.gpu
async def test_pausable_engine_after_a_closed_one_replays_its_graphs_across_release(
    tiny_model_path: str,
) -> None:
    """cuBLAS keeps one workspace for torch's capture stream: graphs that baked in the one an
    earlier engine's capture took from its pool read freed memory once a release cleared it (the
    closed engine's pool then goes back to the driver), an illegal memory access on the first
    replay after resume. Each capture takes its own."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=12)
    first = LocalEngine.load(tiny_model_path, device="cuda", dtype="bfloat16", max_batch_size=4)
    await asyncio.gather(*[first.generate(p, sampling) for p in PROMPTS[:3]])
    assert first.stats.num_graph_replays > 0
    await first.close()
    del first
    gc.collect()  # the closed engine's graphs, and with them its pool
    eng = LocalEngine.load(tiny_model_path, device="cuda", dtype="bfloat16", max_batch_size=4)
    before = await eng.generate(PROMPTS[0], sampling)
    await eng.release_memory()
    await eng.resume_memory()
    replays = eng.stats.num_graph_replays
    after = await eng.generate(PROMPTS[0], sampling)
    torch.cuda.synchronize()
    assert eng.stats.num_graph_replays > replays
    assert after.ids == before.ids
    await eng.close()


@pytest.mark.gpu
async def test_cuda_run_ahead_decode_ends_rows_exactly_and_keeps_batch_mates_exact(
    tiny_model_path: str,
) -> None:
    """Graph decode steps run one ahead of the stop checks: a row that a stop id or its length
    ends still ends exactly there (its extra token is dropped) and its batch mates stay exact."""
    eng = LocalEngine.load(tiny_model_path, device="cuda", dtype="bfloat16", max_batch_size=8)
    stops = list(range(3, 49152, 13))  # 8% of the ids of the tiny model (49,152) end a row
    requests = [
        SamplingParams(temperature=1.0, max_new_tokens=n, seed=i, stop_token_ids=stops)
        for i, n in enumerate((64, 5, 64, 33, 64))
    ]
    results = await asyncio.gather(
        *[eng.generate(p, s) for p, s in zip(PROMPTS, requests, strict=True)]
    )
    for prompt, sampling, c in zip(PROMPTS, requests, results, strict=True):
        stopped_at = [i for i, t in enumerate(c.ids) if t in stops]
        if c.finish_reason == FinishReason.STOP:
            assert stopped_at == [len(c.ids) - 1]
        else:
            assert (c.finish_reason, stopped_at) == (FinishReason.LENGTH, [])
            assert len(c.ids) == sampling.max_new_tokens
        expected = teacher_forced_logprobs(
            eng.model, prompt, c.ids, sampling.temperature, sampling.top_k, sampling.top_p
        )
        assert_bf16_teacher_forced(c.logprobs, expected)
    assert any(c.finish_reason == FinishReason.STOP and len(c.ids) > 2 for c in results)
    assert eng.stats.num_run_ahead_steps > 0
    await eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_cuda_prefix_reuse(tiny_model_path: str, dtype: str) -> None:
    eng = LocalEngine.load(tiny_model_path, device="cuda", dtype=dtype, max_batch_size=8)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16)
    ids = list(PROMPTS[3])
    for turn in range(3):
        c = await eng.generate(ids, sampling, routing_key="episode")
        full = await eng.generate(ids, sampling)
        assert (c.cached_tokens > 0) == (turn > 0)
        if dtype == "float32":
            assert c.ids == full.ids
        ids = next_turn(ids, c.ids, turn)
    await eng.close()


@pytest.mark.gpu
async def test_cuda_release_mid_generation_prefills_again_and_finishes(
    tiny_model_path: str,
) -> None:
    eng = LocalEngine.load(tiny_model_path, device="cuda", dtype="bfloat16", max_batch_size=8)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=400, seed=9)
    running = [asyncio.ensure_future(eng.generate(p, sampling)) for p in PROMPTS[:3]]
    while eng.stats.num_decode_steps < 20:
        await asyncio.sleep(0.001)
    await eng.release_memory()
    assert not any(task.done() for task in running)
    await eng.resume_memory()
    for prompt, c in zip(PROMPTS[:3], await asyncio.gather(*running), strict=True):
        assert len(c.ids) == 400
        expected = teacher_forced_logprobs(
            eng.model, prompt, c.ids, sampling.temperature, sampling.top_k, sampling.top_p
        )
        assert_bf16_teacher_forced(c.logprobs, expected)
    await eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("pausable", pausable_modes())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_cuda_release_without_host_copy_refuses_until_weights_are_sent(
    tiny_model_path: str, pausable: bool, dtype: str
) -> None:
    """weights_cpu_backup=False (a colocated engine): release frees the weights without a host
    copy; after resume nothing runs until every weight is sent again, then outputs match."""
    eng = LocalEngine.load(
        tiny_model_path, device="cuda", dtype=dtype, weights_cpu_backup=False,
        pausable_memory=pausable,
    )  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = await eng.generate(PROMPTS[0], greedy)
    weights = [(n, t.detach().clone()) for n, t in eng.model.state_dict().items()]
    arena_bytes, free_before = eng.arena.nbytes, device_free_bytes()
    await eng.release_memory()
    assert device_free_bytes() - free_before >= arena_bytes  # the KV arena (and weights) gone
    await eng.resume_memory(["weights"])  # as a colocated sync: weights, update, then KV
    assert set(eng.last_resume_s) == {"weights"}  # timed per tag, only what was resumed
    assert device_free_bytes() - free_before >= arena_bytes  # the KV arena is not back yet
    with pytest.raises(EngineError, match="dropped by release_memory"):
        await eng.generate(PROMPTS[0], greedy)
    await eng.update_weights(weights, weight_version=1)
    waiting = asyncio.ensure_future(eng.generate(PROMPTS[0], greedy))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # no KV arena yet: the request waits for it
    await eng.resume_memory(["kv_cache"])
    assert set(eng.last_resume_s) == {"kv_cache"} and eng.last_resume_s["kv_cache"] > 0
    after = await asyncio.wait_for(waiting, 60)
    assert eng.arena.nbytes > 0
    free_open = device_free_bytes()
    await eng.close()
    if pausable:  # closing gives the pausable regions back to the device
        assert device_free_bytes() - free_open >= arena_bytes
    assert after.ids == before.ids and after.weight_version == 1
