"""Rotary embeddings over packed (THD) sequences in one pass, with no host sync.

Without TransformerEngine's fused RoPE, megatron-core's THD path (`rope_utils.
_apply_rotary_pos_emb_thd`) reads `cu_seqlens` back to the host (`.tolist()`, `.item()`: two
device syncs) and rotates one sequence at a time, for the queries and the keys of every layer:
on a GRPO batch of many short episodes, thousands of small operators a step and a CPU that can
never run ahead of the GPU. The rotation is the same for every token given its position within
its sequence, so `install()` swaps in a version that gathers each token's frequencies (its
offset from its sequence start, found on the device) and rotates all tokens with megatron's own
`_apply_rotary_pos_emb_bshd`: the same arithmetic on the same values, bit for bit.

Context parallelism (whose ranks hold two slices of each sequence) keeps megatron's path.
"""

from __future__ import annotations

from typing import Any

import agentrl.trainer.megatron.saver_compat  # noqa: F401  (before megatron.core: see there)

# isort: split
import torch
from megatron.core.models.common.embeddings import rope_utils
from torch import Tensor

_megatron_thd = rope_utils._apply_rotary_pos_emb_thd
# What `_apply_rotary_pos_emb_bshd` takes in every version this was checked against (0.16, 0.19);
# a THD call with anything else (a newer megatron-core's option) keeps megatron's own path.
_BSHD_KWARGS = frozenset(
    {"rotary_interleaved", "multi_latent_attention", "mla_rotary_interleaved", "mscale"}
)


def apply_rotary_pos_emb_thd(
    t: Tensor, cu_seqlens: Tensor, freqs: Tensor, *args: Any, cp_group: Any = None, **kwargs: Any
) -> Tensor:
    """`t` [T, H, D] of sequences packed back to back (sequence i is rows cu_seqlens[i] to
    cu_seqlens[i+1]); `freqs` [max_seqlen, 1, 1, D'] (position p of any sequence), or [T, 1, 1,
    D'] (one row per packed token, as megatron-core 0.19 also accepts)."""
    if args or not kwargs.keys() <= _BSHD_KWARGS or (cp_group is not None and cp_group.size() > 1):
        return _megatron_thd(t, cu_seqlens, freqs, *args, cp_group=cp_group, **kwargs)
    num_tokens = t.size(0)
    if freqs.size(0) != num_tokens:  # by position within each sequence
        starts = cu_seqlens[:-1].long()
        lengths = cu_seqlens[1:].long() - starts
        offsets = torch.repeat_interleave(starts, lengths, output_size=num_tokens)
        freqs = freqs[torch.arange(num_tokens, device=t.device) - offsets]
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs, **kwargs).squeeze(1)


def install() -> None:
    """Route megatron-core's unfused THD RoPE through `apply_rotary_pos_emb_thd` (idempotent)."""
    rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd
