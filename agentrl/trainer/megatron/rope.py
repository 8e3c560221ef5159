"""Rotary embeddings over packed (THD) sequences in one pass, with no host sync.

Without TransformerEngine's fused RoPE, megatron-core's THD path (`rope_utils.
_apply_rotary_pos_emb_thd`) reads `cu_seqlens` back to the host (`.tolist()`, `.item()`: two
device syncs) and rotates one sequence at a time, for the queries and the keys of every layer:
on a GRPO batch of many short episodes, thousands of small operators a step and a CPU that can
never run ahead of the GPU. The rotation is the same for every token given its position within
its sequence, so `install()` swaps in a version that gathers each token's frequencies (its
offset from its sequence start, found on the device) and rotates all tokens with megatron's own
`_apply_rotary_pos_emb_bshd`'s arithmetic: the same values, bit for bit on the CPU. The cos and
sin of those frequencies are computed once per forward, not once per layer, and on CUDA the
rotation compiles into one kernel each way.

Context parallelism (whose ranks hold two slices of each sequence) keeps megatron's path, as do
an interleaved, multi-latent or partial RoPE (agentrl's Llama / Qwen models use none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import agentrl.trainer.megatron.saver_compat  # noqa: F401  (before megatron.core: see there)

# isort: split
import torch
from megatron.core.models.common.embeddings import rope_utils
from torch import Tensor

_megatron_thd = rope_utils._apply_rotary_pos_emb_thd
# What `_apply_rotary_pos_emb_bshd` takes in every version this was checked against (0.16, 0.19);
# a THD call with anything else (a newer megatron-core's option), or any of these but mscale
# turned on, keeps megatron's own path.
_NOT_PLAIN = ("rotary_interleaved", "multi_latent_attention", "mla_rotary_interleaved")
_BSHD_KWARGS = frozenset({*_NOT_PLAIN, "mscale"})


def _rotate_halves(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """megatron's bshd rotation (non-interleaved, every channel rotated) given its cos and sin."""
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


# On CUDA the rotation's elementwise kernels each way (the rotated half's negation and
# concatenation, products, sum) compile into one (megatron's own fusions use torch.compile the
# same way). A new token count makes the token dimension dynamic: a recompilation or two (dynamo
# specialises counts 0 and 1 apart), per grad mode.
_rotate_halves_fused = torch.compile(_rotate_halves)


@dataclass
class _Angles:
    """Each packed token's frequencies, and their cos and sin by (dtype, mscale), for one
    (cu_seqlens, freqs) pair: every layer's queries and keys in a forward share them."""

    cu_seqlens: Tensor
    freqs: Tensor
    per_token: Tensor  # [T, 1, 1, D']
    cos_sin: dict[tuple[torch.dtype, float], tuple[Tensor, Tensor]] = field(default_factory=dict)

    def cos_and_sin(self, dtype: torch.dtype, mscale: float) -> tuple[Tensor, Tensor]:
        """[T, 1, D'] each, as megatron computes them: (cos(freqs) * mscale).to(dtype)."""
        if (dtype, mscale) not in self.cos_sin:
            freqs = self.per_token.squeeze(1)
            self.cos_sin[dtype, mscale] = (
                (torch.cos(freqs) * mscale).to(dtype),
                (torch.sin(freqs) * mscale).to(dtype),
            )
        return self.cos_sin[dtype, mscale]


_last: _Angles | None = None  # the last micro-batch's, until `forget_angles`


def _angles(cu_seqlens: Tensor, freqs: Tensor, num_tokens: int) -> _Angles:
    global _last
    if _last is not None and _last.cu_seqlens is cu_seqlens and _last.freqs is freqs:
        return _last
    per_token = freqs
    if freqs.size(0) != num_tokens:  # by position within each sequence
        starts = cu_seqlens[:-1].long()
        lengths = cu_seqlens[1:].long() - starts
        offsets = torch.repeat_interleave(starts, lengths, output_size=num_tokens)
        per_token = freqs[torch.arange(num_tokens, device=freqs.device) - offsets]
    _last = _Angles(cu_seqlens, freqs, per_token)
    return _last


def forget_angles() -> None:
    """Drop the cached angles (and the tensors that key them)."""
    global _last
    _last = None


def apply_rotary_pos_emb_thd(
    t: Tensor, cu_seqlens: Tensor, freqs: Tensor, *args: Any, cp_group: Any = None, **kwargs: Any
) -> Tensor:
    """`t` [T, H, D] of sequences packed back to back (sequence i is rows cu_seqlens[i] to
    cu_seqlens[i+1]); `freqs` [max_seqlen, 1, 1, D'] (position p of any sequence), or [T, 1, 1,
    D'] (one row per packed token, as megatron-core 0.19 also accepts)."""
    is_plain = kwargs.keys() <= _BSHD_KWARGS and not any(kwargs.get(k) for k in _NOT_PLAIN)
    # Megatron's own path for partial RoPE and for context parallelism (a group of > 1 ranks).
    if args or not is_plain or freqs.size(-1) != t.size(-1) or getattr(cp_group, "size", int)() > 1:
        return _megatron_thd(t, cu_seqlens, freqs, *args, cp_group=cp_group, **kwargs)
    angles = _angles(cu_seqlens, freqs, t.size(0))
    cos, sin = angles.cos_and_sin(t.dtype, float(kwargs.get("mscale", 1.0)))
    return (_rotate_halves_fused if t.is_cuda else _rotate_halves)(t, cos, sin)


def install() -> None:
    """Route megatron-core's unfused THD RoPE through `apply_rotary_pos_emb_thd` (idempotent)."""
    rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd
