"""The split-K decode attention kernel against per-sequence attention in fp32, on CPU under
Triton's interpreter (skipped where triton is not installed; the GPU tests run it compiled)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch

if not torch.cuda.is_available():  # triton reads it as it decorates, its own library included
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")


@pytest.fixture
def kernel() -> ModuleType:
    return importlib.import_module("agentrl.engine.local.decode_attention")


def reference(q, keys, values, starts, lens, scale) -> torch.Tensor:
    group = q.shape[1] // keys.shape[1]
    out = []
    for b, (s, n) in enumerate(zip(starts, lens, strict=True)):
        k = keys[s : s + n].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
        v = values[s : s + n].double().repeat_interleave(group, dim=1).transpose(0, 1)
        w = torch.softmax((k @ q[b].double()[:, :, None])[..., 0] * scale, dim=-1)  # [H, n]
        out.append((w[:, None, :] @ v)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3)])
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("splits", [1, 4, 16])
def test_split_k_decode_matches_attention_over_each_sequences_own_keys(
    kernel: ModuleType, heads: int, kv_heads: int, head_major: bool, splits: int
) -> None:
    """Lengths from 1 (most splits empty) past one block to the whole slot; a garbage tail after
    every sequence (never read); q as the fused projection leaves it (a strided view)."""
    g = torch.Generator().manual_seed(splits)
    dim, slot, lens = 16, 150, [1, 7, 64, 65, 150, 3]
    rows = slot * len(lens)
    shape = (kv_heads, rows, dim) if head_major else (rows, kv_heads, dim)
    keys, values = (torch.randn(*shape, generator=g) for _ in range(2))
    if head_major:
        keys, values = keys.permute(1, 0, 2), values.permute(1, 0, 2)
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, dim, generator=g)
    q = qkv[:, :heads]
    starts = [i * slot for i in range(len(lens))]
    scale = dim**-0.5
    got = kernel.split_k_decode(
        q, keys, values, torch.tensor(starts, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), scale, splits,
    )  # fmt: skip
    assert got.shape == (len(lens), heads, dim) and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), reference(q, keys, values, starts, lens, scale),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_num_splits_fills_the_device_twice_in_powers_of_two(kernel: ModuleType) -> None:
    assert (
        kernel.num_splits(batch=1, kv_heads=32, num_sms=132) == 16
    )  # 264 programs wanted: 9 -> 16
    assert kernel.num_splits(batch=8, kv_heads=32, num_sms=132) == 2
    assert kernel.num_splits(batch=64, kv_heads=32, num_sms=132) == 1
    assert kernel.num_splits(batch=1, kv_heads=1, num_sms=132) == 16  # at most 16
