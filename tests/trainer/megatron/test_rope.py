"""RoPE over packed sequences: agentrl's one-pass THD rotation equals megatron-core's
one-sequence-at-a-time path bit for bit (values and gradients), and on CUDA it never syncs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'agentrl[megatron]')"
)

from agentrl.trainer.megatron import rope


class Group:
    """A context-parallel group of one (what megatron passes without context parallelism)."""

    def __init__(self, size: int = 1) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def _inputs(lengths: list[int], dtype: torch.dtype, device: str = "cpu", heads: int = 3):
    g = torch.Generator().manual_seed(0)
    dim = 16
    t = torch.randn(sum(lengths), heads, dim, generator=g).to(device=device, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(max(lengths)).float(), inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :]  # [max_s, 1, 1, dim], as megatron's
    return t.requires_grad_(), cu.to(device), freqs.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_equals_megatrons_per_sequence_rotation(dtype):
    lengths = [5, 1, 9, 3, 7]  # a one-token sequence among them
    t, cu, freqs = _inputs(lengths, dtype)
    ours = rope.apply_rotary_pos_emb_thd(t, cu, freqs, rotary_interleaved=False, cp_group=Group())
    t2 = t.detach().clone().requires_grad_()
    theirs = rope._megatron_thd(t2, cu, freqs, rotary_interleaved=False, cp_group=Group())
    assert torch.equal(ours, theirs)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    assert t.grad is not None and t2.grad is not None and torch.equal(t.grad, t2.grad)
    # Each sequence restarts at position 0: its first token is rotated by angle 0 (unchanged).
    first_tokens = cu[:-1].long()
    assert torch.equal(ours[first_tokens], t.detach()[first_tokens])


def test_per_token_frequencies_are_used_as_given():
    """freqs with one row per packed token (megatron-core 0.19's other THD form) are applied
    as they are, not indexed again by position."""
    lengths = [4, 6]
    t, cu, _ = _inputs(lengths, torch.float32)
    per_token = torch.randn(sum(lengths), 1, 1, t.shape[-1])
    ours = rope.apply_rotary_pos_emb_thd(t, cu, per_token, cp_group=Group())
    from megatron.core.models.common.embeddings import rope_utils

    expected = rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), per_token).squeeze(1)
    assert torch.equal(ours, expected)


def test_new_sequence_bounds_are_never_served_stale_frequencies():
    """The per-token frequencies are kept for the last (cu_seqlens, freqs) pair, which every
    layer of one forward shares; the next micro-batch's bounds (same freqs) gather anew."""
    t, cu, freqs = _inputs([5, 9], torch.float32)
    first = rope.apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=Group())
    again = rope.apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=Group())
    assert torch.equal(first, again)
    cu2 = torch.tensor([0, 9, 14], dtype=torch.int32)  # the same 14 tokens as [9, 5]
    ours = rope.apply_rotary_pos_emb_thd(t, cu2, freqs, cp_group=Group())
    theirs = rope._megatron_thd(t, cu2, freqs, cp_group=Group())
    assert torch.equal(ours, theirs) and not torch.equal(ours, first)


@pytest.mark.parametrize("option", [{}, {"rotary_interleaved": True}, {"mscale": 0.5}])
def test_partial_interleaved_and_scaled_rotations_equal_megatrons(option):
    """A RoPE over the first half of each head's channels (the rest passed through), megatron's
    interleaved variant (both on megatron's own path), and a scaled one: megatron's values."""
    t, cu, freqs = _inputs([6, 3], torch.float32)
    partial = freqs[..., : t.shape[-1] // 2]
    ours = rope.apply_rotary_pos_emb_thd(t, cu, partial, cp_group=Group(), **option)
    theirs = rope._megatron_thd(t, cu, partial, cp_group=Group(), **option)
    assert torch.equal(ours, theirs)
    ours = rope.apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=Group(), **option)
    assert torch.equal(ours, rope._megatron_thd(t, cu, freqs, cp_group=Group(), **option))


def test_context_parallel_and_unknown_options_keep_megatrons_path(monkeypatch):
    calls = []
    monkeypatch.setattr(rope, "_megatron_thd", lambda *a, **k: calls.append(k) or a[0])
    t, cu, freqs = _inputs([4, 4], torch.float32)
    rope.apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=Group(size=2))
    assert len(calls) == 1 and calls[0]["cp_group"].size() == 2
    # An option megatron's bshd rotation may not take (a newer THD signature's): its own path.
    rope.apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=Group(), inverse=True)
    assert len(calls) == 2 and calls[1]["inverse"] is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_device_sync_on_cuda():
    """megatron's own path reads cu_seqlens to the host twice per call; this one never does."""
    t, cu, freqs = _inputs([300, 17, 1, 211], torch.bfloat16, device="cuda")
    rope.apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=Group()).float().sum().backward()
    torch.cuda.synchronize()  # compiled (the first call) before syncs are counted
    torch.cuda.set_sync_debug_mode("error")
    try:  # new bounds (not the warm-up's cached angles): the frequency gather runs here too
        out = rope.apply_rotary_pos_emb_thd(t, cu.clone(), freqs, cp_group=Group())
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(RuntimeError, match="synchroniz"):
        torch.cuda.set_sync_debug_mode("error")
        try:
            rope._megatron_thd(t.detach(), cu, freqs, cp_group=Group())
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2**-6)])
def test_compiled_rotation_on_cuda_equals_megatrons(dtype, tol):
    """On CUDA the rotation is one compiled kernel each way; values and gradients equal
    megatron's eager path within the dtype's rounding, over several token counts (the token
    dimension turns dynamic after the first)."""
    for lengths in ([300, 17, 1, 211], [64, 64], [1000]):
        t, cu, freqs = _inputs(lengths, dtype, device="cuda", heads=4)
        ours = rope.apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=Group())
        t2 = t.detach().clone().requires_grad_()
        theirs = rope._megatron_thd(t2, cu, freqs, cp_group=Group())
        # bf16: a unit or two in the last place (the kernel rounds once, eager after each op)
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)
        weights = torch.randn(ours.shape, device="cuda").to(dtype)
        (ours * weights).float().sum().backward()
        (theirs * weights).float().sum().backward()
        assert t.grad is not None and t2.grad is not None
        torch.testing.assert_close(t.grad.float(), t2.grad.float(), rtol=2 * tol, atol=2 * tol)
