"""Token logprobs and entropies from final hidden states, a chunk of tokens at a time, so the
[tokens, vocab] logits never exist whole (not in the forward pass, not saved for backward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, target_ids: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """[C, H] -> logprob of target [C] and entropy [C] of softmax(logits / T), in float32."""
    logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    logits = logits / temperature  # [C, V]
    log_z = torch.logsumexp(logits, dim=-1)  # [C]
    target_logits = logits.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    entropy = log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return target_logits - log_z, entropy


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target_ids: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """log_softmax(hidden @ weight.T / T)[target] and the entropy, for hidden [M, H] -> [M], [M].

    With gradients on, each chunk is recomputed in backward (activation checkpointing), so only
    one chunk of logits is alive at any time; the engine's logprobs use the same definition."""
    if chunk_size < 1:
        raise ValueError(f"train.logprob_chunk_size={chunk_size} must be >= 1")
    if temperature <= 0:
        raise ValueError(
            f"temperature={temperature} must be > 0 for logprobs (greedy rollouts use T=1)"
        )
    logprob_parts, entropy_parts = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h = hidden[start : start + chunk_size]
        t = target_ids[start : start + chunk_size]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            lp, ent = checkpoint(
                _chunk_logprobs, h, weight, bias, t, temperature, use_reentrant=False
            )
        else:
            lp, ent = _chunk_logprobs(h, weight, bias, t, temperature)
        logprob_parts.append(lp)
        entropy_parts.append(ent)
    if not logprob_parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logprob_parts), torch.cat(entropy_parts)
