"""A `MicroBatch` ([rows, T], positions restarting at 0 for every sequence) flattened into the
THD form Megatron takes for packed sequences: one row of tokens and the cumulative sequence
lengths, so no token is padding except the few that make the length a multiple of the TP size
under sequence parallelism."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PackedTokens:
    input_ids: Tensor  # [1, N] long
    position_ids: Tensor  # [1, N] long
    cu_seqlens: Tensor  # [S + 1] int32: sequence i is tokens cu_seqlens[i]:cu_seqlens[i + 1]
    max_seqlen: int
    num_tokens: int  # tokens of the micro-batch; the rest of the N are alignment padding

    def unflatten(self, values: Tensor, shape: torch.Size) -> Tensor:
        """Per-token values [N] -> [rows, T] in the micro-batch's layout."""
        return values[: self.num_tokens].reshape(shape)


def pack_tokens(
    input_ids: Tensor, position_ids: Tensor, *, pad_id: int, multiple: int = 1
) -> PackedTokens:
    """[R, T] rows -> one THD row. A sequence starts wherever a position is 0 (right padding of
    unpacked rows continues its row's positions, so it rides at the end of that sequence, after
    every real token, which causal attention never lets it reach). The length is rounded up to
    `multiple` with one extra pad sequence."""
    ids, positions = input_ids.reshape(-1), position_ids.reshape(-1)
    num_tokens = ids.numel()
    pad = -num_tokens % multiple
    if pad:
        ids = torch.cat([ids, ids.new_full((pad,), pad_id)])
        positions = torch.cat([positions, torch.arange(pad, device=positions.device)])
    starts = (positions == 0).nonzero()[:, 0]
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("the micro-batch's first position must be 0 (a sequence start)")
    end = torch.tensor([ids.numel()], device=starts.device)
    cu_seqlens = torch.cat([starts, end]).to(torch.int32)
    return PackedTokens(
        input_ids=ids[None],
        position_ids=positions[None],
        cu_seqlens=cu_seqlens,
        max_seqlen=int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
        num_tokens=num_tokens,
    )
