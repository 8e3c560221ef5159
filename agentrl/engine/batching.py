"""Continuous batching on a transformers model: per-request `Sequence` state and the running
`DecodeBatch` (left-padded KV cache + attention mask) that sequences join and leave between steps.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from agentrl.engine.base import Completion, FinishReason, SamplingParams
from agentrl.engine.sampling import RowSampling


@dataclass
class Sequence:
    """One generate request: its prompt, sampling, what it produced so far, and who awaits it."""

    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future[Completion]
    loop: asyncio.AbstractEventLoop
    row: RowSampling
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    is_cancelled: bool = False

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: FinishReason, matched_stop: str | int | None = None) -> None:
        self.finish_reason, self.matched_stop = reason, matched_stop

    def to_completion(self, weight_version: str) -> Completion:
        return Completion(
            ids=list(self.output_ids),
            logprobs=list(self.output_logprobs),
            finish_reason=self.finish_reason or FinishReason.ABORT,
            weight_version=weight_version,
            matched_stop=self.matched_stop,
            prompt_tokens=len(self.prompt_ids),
        )


class StopChecker:
    """Decides after each new token whether a sequence is done (stop id, stop string, length)."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int], max_positions: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_positions = max_positions

    def check(self, seq: Sequence) -> None:
        last = seq.output_ids[-1]
        if last in self.eos_token_ids or last in seq.sampling.stop_token_ids:
            seq.finish(FinishReason.STOP, last)
        elif (stop := self._matched_stop_string(seq)) is not None:
            seq.finish(FinishReason.STOP, stop)
        elif (
            len(seq.output_ids) >= seq.sampling.max_new_tokens
            or len(seq.prompt_ids) + len(seq.output_ids) >= self.max_positions
        ):
            seq.finish(FinishReason.LENGTH)

    def _matched_stop_string(self, seq: Sequence) -> str | None:
        stops = seq.sampling.stop
        if not stops:
            return None
        # Only the decoded tail can hold a new match: earlier text was checked at earlier steps.
        # A character may span up to 4 byte-level tokens, so the window is sized in bytes.
        window = 4 * max(len(s) for s in stops) + 2
        tail = self.tokenizer.decode(seq.output_ids[-window:], skip_special_tokens=False)
        return next((s for s in stops if s and s in tail), None)


def _cache_kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def _set_cache_kv(cache: DynamicCache, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if hasattr(cache, "layers"):
        for layer, (k, v) in zip(cache.layers, kv, strict=True):
            layer.keys, layer.values = k, v
    else:
        cache.key_cache, cache.value_cache = [k for k, _ in kv], [v for _, v in kv]


def _left_pad(t: torch.Tensor, total: int, dim: int) -> torch.Tensor:
    missing = total - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@dataclass
class DecodeBatch:
    """Running sequences with a shared left-padded KV cache; row i of every tensor is sequences[i].

    Positions come from the attention mask (real tokens only), so a row's logits do not depend on
    how much padding its batch mates force on it.
    """

    sequences: list[Sequence]
    cache: DynamicCache
    attention_mask: torch.Tensor  # [B, L] 1 = real token
    next_input_ids: torch.Tensor  # [B] the last sampled token of each row, not yet in the cache

    def __len__(self) -> int:
        return len(self.sequences)

    def merge(self, other: DecodeBatch) -> None:
        """Append `other`'s rows, left-padding whichever cache is shorter."""
        total = max(self.attention_mask.shape[1], other.attention_mask.shape[1])
        kv = [
            (
                torch.cat([_left_pad(k1, total, 2), _left_pad(k2, total, 2)]),
                torch.cat([_left_pad(v1, total, 2), _left_pad(v2, total, 2)]),
            )
            for (k1, v1), (k2, v2) in zip(
                _cache_kv(self.cache), _cache_kv(other.cache), strict=True
            )
        ]
        _set_cache_kv(self.cache, kv)
        self.attention_mask = torch.cat(
            [_left_pad(self.attention_mask, total, 1), _left_pad(other.attention_mask, total, 1)]
        )
        self.next_input_ids = torch.cat([self.next_input_ids, other.next_input_ids])
        self.sequences += other.sequences

    def keep(self, keep: list[int]) -> None:
        """Keep only rows `keep` and drop cache columns that are padding in every kept row."""
        index = torch.tensor(keep, device=self.attention_mask.device)
        mask = self.attention_mask.index_select(0, index)
        first = int(mask.any(dim=0).nonzero()[0]) if len(keep) else mask.shape[1]
        _set_cache_kv(
            self.cache,
            [
                (k.index_select(0, index)[:, :, first:], v.index_select(0, index)[:, :, first:])
                for k, v in _cache_kv(self.cache)
            ],
        )
        self.attention_mask = mask[:, first:]
        self.next_input_ids = self.next_input_ids.index_select(0, index)
        self.sequences = [self.sequences[i] for i in keep]

    def to(self, device: torch.device | str) -> None:
        _set_cache_kv(self.cache, [(k.to(device), v.to(device)) for k, v in _cache_kv(self.cache)])
        self.attention_mask = self.attention_mask.to(device)
        self.next_input_ids = self.next_input_ids.to(device)


@torch.inference_mode()
def prefill(model: Any, sequences: list[Sequence], pad_id: int) -> tuple[DecodeBatch, torch.Tensor]:
    """Run the prompts (left-padded) through the model. Returns the batch and last logits [B, V]."""
    device = model.device
    length = max(len(s.prompt_ids) for s in sequences)
    input_ids = torch.tensor(
        [[pad_id] * (length - len(s.prompt_ids)) + s.prompt_ids for s in sequences], device=device
    )  # [B, L]
    mask = torch.tensor(
        [[0] * (length - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in sequences],
        device=device,
    )  # [B, L]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    empty = torch.zeros(len(sequences), dtype=torch.long, device=device)
    return DecodeBatch(list(sequences), out.past_key_values, mask, empty), out.logits[:, -1]


@torch.inference_mode()
def decode_step(model: Any, batch: DecodeBatch) -> torch.Tensor:
    """Feed each row's pending token; returns the next logits [B, V]."""
    ones = batch.attention_mask.new_ones(len(batch), 1)
    batch.attention_mask = torch.cat([batch.attention_mask, ones], dim=1)  # [B, L+1]
    position_ids = batch.attention_mask.sum(-1, keepdim=True) - 1  # [B, 1]
    out = model(
        input_ids=batch.next_input_ids[:, None],
        attention_mask=batch.attention_mask,
        position_ids=position_ids,
        past_key_values=batch.cache,
        use_cache=True,
    )
    batch.cache = out.past_key_values
    return out.logits[:, -1]
