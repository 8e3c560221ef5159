"""Packed oneDNN linears on CPU: same products as F.linear, fresh after weight changes, only inside
the engine's forwards, and an engine using them still matches a teacher-forced transformers pass."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
import torch.nn.functional as F

from agentrl.engine.base import SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.engine.local.cpu_linear import PackedLinears, packing_supported

pytestmark = pytest.mark.skipif(
    not packing_supported("cpu", torch.float32), reason="oneDNN packing runs on x86 CPUs only"
)


def linear_model(rows: int = 576, cols: int = 1536) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(cols, rows), torch.nn.Linear(rows, 64, bias=False))


def test_packed_products_equal_f_linear_at_decode_and_prefill_sizes() -> None:
    model = linear_model()
    packed = PackedLinears.install(model)
    assert packed is not None
    for num_rows in (1, 8, 33, 1024):
        x = torch.randn(1, num_rows, 1536)
        with torch.inference_mode():
            plain = model(x)
            with packed.active():
                fast = model(x)
        assert fast.shape == plain.shape
        assert (fast - plain).abs().max() < 1e-4 * plain.abs().max()
    assert packed.nbytes == sum(p.numel() * 4 for n, p in model.named_parameters() if "weight" in n)


def test_an_in_place_weight_update_is_packed_again() -> None:
    model = linear_model()
    packed = PackedLinears.install(model)
    assert packed is not None
    x = torch.randn(4, 1536)
    with torch.inference_mode(), packed.active():
        before = model(x)
    with torch.no_grad():  # as LocalEngine.update_weights copies a new weight in
        model[1].weight.copy_(torch.randn_like(model[1].weight))
    with torch.inference_mode():
        plain = model(x)
        with packed.active():
            after = model(x)
    assert not torch.allclose(after, before)  # a stale packed copy would return `before`
    assert torch.allclose(after, plain, atol=1e-4)


def test_calls_outside_active_and_from_other_threads_stay_plain_f_linear() -> None:
    model = linear_model()
    packed = PackedLinears.install(model)
    assert packed is not None
    x = torch.randn(3, 1536)
    expected = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight)
    seen: list[torch.Tensor] = []
    with torch.inference_mode():
        assert torch.equal(model(x), expected)  # bitwise: transformers' own computation
        with packed.active():
            thread = threading.Thread(target=lambda: seen.append(model(x)))
            thread.start()
            thread.join()
    assert torch.equal(seen[0], expected)


def test_no_packing_on_other_dtypes() -> None:
    assert PackedLinears.install(linear_model().to(torch.bfloat16)) is None
    assert not packing_supported("cuda", torch.float32)


@pytest.fixture(scope="module")
def wide_model_path(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """SmolLM2-135M's hidden size (oneDNN picks other kernels at real widths than at 64)."""
    from tests.support.models import make_tiny_model

    out = tmp_path_factory.mktemp("wide_model")
    return make_tiny_model(str(out), smollm2_path, num_layers=2, hidden_size=576, seed=1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_packed_engine_logprobs_equal_a_teacher_forced_pass(
    wide_model_path: str, temperature: float
) -> None:
    engine = LocalEngine.load(wide_model_path, device="cpu", dtype="float32", max_batch_size=4)
    plain = LocalEngine.load(
        wide_model_path, device="cpu", dtype="float32", max_batch_size=4, pack_cpu_linears=False
    )
    try:
        assert engine._packed is not None and plain._packed is None
        sampling = SamplingParams(temperature=temperature, max_new_tokens=12, seed=3)
        prompts = [list(range(200, 200 + n)) for n in (5, 70, 19)]
        got = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
        ref = await asyncio.gather(*(plain.generate(p, sampling) for p in prompts))
        assert engine._packed.nbytes > 0  # the packed path ran
        for prompt, c, r in zip(prompts, got, ref, strict=True):
            with torch.no_grad():
                logits = engine.model(torch.tensor([prompt + c.ids])).logits[
                    0, len(prompt) - 1 : -1
                ]
            t = temperature or 1.0
            expected = torch.log_softmax(logits / t, -1).gather(1, torch.tensor(c.ids)[:, None])
            assert (torch.tensor(c.logprobs) - expected[:, 0]).abs().mean() <= 1e-4
            assert c.ids == r.ids  # same tokens as F.linear's engine
    finally:
        await engine.close()
        await plain.close()
