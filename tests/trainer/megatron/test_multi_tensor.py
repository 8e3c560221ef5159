"""megatron-core's multi-tensor operators on foreach kernels: the same results as its local
Python-loop fallbacks (test_patches.py: installed in their place when neither Apex nor
TransformerEngine is)."""

from __future__ import annotations

import pytest
import torch

# The module first: it imports megatron-core past a memory saver another test initialised.
multi_tensor = pytest.importorskip("agentrl.trainer.megatron.multi_tensor")

from megatron.core import utils as megatron_utils  # noqa: E402


def _tensors(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(dtype) for shape in ((7, 5), (3,), (11, 2, 4))]


def test_l2_norm_of_all_tensors_together():
    tensors = _tensors()
    noop = torch.zeros(1, dtype=torch.int)
    norm, per_tensor = multi_tensor.multi_tensor_l2norm(2048, noop, [tensors], False)
    expected = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in tensors]))
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], expected, rtol=1e-6, atol=0)
    empty, _ = multi_tensor.multi_tensor_l2norm(2048, noop, [[]], False)
    assert empty.tolist() == [0.0]
    with pytest.raises(NotImplementedError):
        multi_tensor.multi_tensor_l2norm(2048, noop, [tensors], True)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_scale_equals_megatrons_loop_bit_for_bit(scale):
    """fp32 master weights -> bf16 model weights (scale 1.0), and clipping's in-place scale."""
    sources = _tensors()
    ours = [torch.empty_like(t, dtype=torch.bfloat16) for t in sources]
    theirs = [torch.empty_like(t) for t in ours]
    noop = torch.zeros(1, dtype=torch.int)
    multi_tensor.multi_tensor_scale(2048, noop, [sources, ours], scale)
    megatron_utils.local_multi_tensor_scale(2048, noop, [sources, theirs], scale)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    in_place = _tensors()
    multi_tensor.multi_tensor_scale(2048, noop, [in_place, in_place], scale)
    assert all(torch.equal(a, b * scale) for a, b in zip(in_place, _tensors(), strict=True))
