"""Next-token sampling for a batch of rows with their own temperature, top-k, top-p and RNG.

The logprob of a sampled id is `log_softmax(logits / T)[id]` (T = 1 when greedy), with no
top-k/top-p renormalisation: the trainer recomputes exactly this quantity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowSampling:
    """How one row picks its next token; `generator` None = the engine's shared RNG."""

    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    generator: torch.Generator | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0


def filter_top_k_top_p(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to -inf. `scaled`: [V] (already divided by T)."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the mass before it already reaches top_p; the top token always stays.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_next(
    logits: torch.Tensor, rows: list[RowSampling], default_generator: torch.Generator | None = None
) -> tuple[list[int], list[float]]:
    """Pick one token per row. `logits`: [B, V] (any float dtype). Returns (ids, logprobs)."""
    logits = logits.float()
    temps = torch.tensor(
        [1.0 if r.is_greedy else r.temperature for r in rows], device=logits.device
    )
    scaled = logits / temps[:, None]  # [B, V]
    logprobs = torch.log_softmax(scaled, dim=-1)  # [B, V]
    ids = torch.argmax(scaled, dim=-1)  # [B], kept for greedy rows
    for i, row in enumerate(rows):
        if row.is_greedy:
            continue
        probs = torch.softmax(filter_top_k_top_p(scaled[i], row.top_k, row.top_p), dim=-1)
        ids[i] = torch.multinomial(probs, 1, generator=row.generator or default_generator)[0]
    picked = logprobs.gather(1, ids[:, None])[:, 0]  # [B]
    return ids.tolist(), picked.tolist()
