"""Sampling-mask replay: the tokens a turn's top-k / top-p filter kept, so the trainer's logprobs
describe the same truncated distribution the engine sampled from and reported.

The filter is the embedded engine's (`engine/local/sampling.filter_top_k_top_p`, which the
trainer may not import): top-k first, then the nucleus of the renormalised top-k distribution,
dropping a token once the mass before it reaches top_p; the top token always stays.
"""

from __future__ import annotations

import torch
from torch import Tensor

OFF_TOP_K = -1  # a token of a turn without replay, or with top-k off
OFF_TOP_P = 1.0


@torch.no_grad()
def kept_tokens(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """[C, V] logits / T, top_k [C] (<= 0: off), top_p [C] (1: off) -> [C, V] bool, True where
    the filter keeps the token."""
    num_vocab = scaled.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, num_vocab))  # [C]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)  # [C, V]
    ranks = torch.arange(num_vocab, device=scaled.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    keep_sorted = torch.isfinite(sorted_logits) & ~drop
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def truncate_logits(scaled: Tensor, target_ids: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """[C, V] logits with every token the filter dropped at -inf, but the target [C], which was
    sampled, so it has a logprob even where the engine's logits put it a hair outside."""
    keep = kept_tokens(scaled.detach(), top_k, top_p)
    keep = keep.scatter(1, target_ids[:, None], True)
    return scaled.masked_fill(~keep, float("-inf"))
