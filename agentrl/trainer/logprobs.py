"""Token logprobs and entropies from final hidden states, a chunk of tokens at a time, so the
[tokens, vocab] logits never exist whole (not in the forward pass, not saved for backward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target_ids: Tensor,
    temperature: float,
    is_entropy_trained: bool,
) -> tuple[Tensor, Tensor]:
    """[C, H] -> logprob of target [C] and entropy [C] of softmax(logits / T), in float32."""
    logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    if temperature != 1.0:
        logits = logits / temperature  # [C, V]
    # Only log_softmax's output is kept for backward; the logits themselves can be freed.
    all_logprobs = torch.log_softmax(logits, dim=-1)  # [C, V]
    logprobs = all_logprobs.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(is_entropy_trained and torch.is_grad_enabled()):
        entropy = -(all_logprobs.exp() * all_logprobs).sum(-1)
    return logprobs, entropy


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target_ids: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    is_entropy_trained: bool = True,
) -> tuple[Tensor, Tensor]:
    """log_softmax(hidden @ weight.T / T)[target] and the entropy, for hidden [M, H] -> [M], [M].

    With gradients on, each chunk is recomputed in backward (activation checkpointing), so only
    one chunk of logits is alive at any time; the engine's logprobs use the same definition.
    With `is_entropy_trained` False the entropy carries no gradient (cheaper; a metric only)."""
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
                _chunk_logprobs,
                h,
                weight,
                bias,
                t,
                temperature,
                is_entropy_trained,
                use_reentrant=False,
            )
        else:
            lp, ent = _chunk_logprobs(h, weight, bias, t, temperature, is_entropy_trained)
        logprob_parts.append(lp)
        entropy_parts.append(ent)
    if not logprob_parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logprob_parts), torch.cat(entropy_parts)
