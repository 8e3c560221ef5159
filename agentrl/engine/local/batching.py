"""Continuous batching: per-request `Sequence` state, the stop checks, and `pack_step`, which lays
out one model step for the running sequences. Every step runs each sequence's tokens that are not
yet in its KV-arena slot, packed into one row: a whole prompt (prefill), the new tail of a
multi-turn input (continued prefill), or the one token sampled last (decode).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl.engine.base import Completion, FinishReason, SamplingParams
from agentrl.engine.local.attention import ArenaStep
from agentrl.engine.local.kv_arena import KVArena


@dataclass
class Sequence:
    """One generate request: its prompt, sampling, what it produced so far, and who awaits it."""

    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future[Completion]
    loop: asyncio.AbstractEventLoop
    seed: int
    """Seeds this request's sampling noise (the request's own seed, or one drawn by the engine)."""
    routing_key: str | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    is_cancelled: bool = False
    slot: int | None = None
    num_cached: int = 0
    """Leading tokens of `token_ids` whose K/V are in the slot."""
    num_reused: int = 0
    """Prompt tokens found in the slot at admission (a multi-turn prefix): SGLang's cached_tokens."""
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    """(weight version, output tokens) before each update the request went on across."""

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def finish(self, reason: FinishReason, matched_stop: str | int | None = None) -> None:
        self.finish_reason = reason
        self.matched_stop = matched_stop

    def sampling_row(self) -> tuple[float, float, int, int, int]:
        s = self.sampling
        return (s.temperature, s.top_p, s.top_k, self.seed, len(self.output_ids))

    def close_span(self, weight_version: int) -> None:
        """The weights change under this request: its tokens so far are `weight_version`'s."""
        num_new = len(self.output_ids) - sum(n for _, n in self.version_spans)
        if num_new:
            self.version_spans.append((weight_version, num_new))

    def to_completion(self, weight_version: int) -> Completion:
        self.close_span(weight_version)  # every token keeps the version that sampled it
        spans = list(self.version_spans)
        weight_version = spans[-1][0] if spans else weight_version
        return Completion(
            ids=list(self.output_ids),
            logprobs=list(self.output_logprobs),
            finish_reason=self.finish_reason or FinishReason.ABORT,
            weight_version=weight_version,
            version_spans=spans if len(spans) > 1 else [],
            matched_stop=self.matched_stop,
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=self.num_reused,
            is_logprob_truncated=self.sampling.top_k > 0 or self.sampling.top_p < 1.0,
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
            or seq.num_tokens >= self.max_positions
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


@dataclass
class PackedStep:
    """Model inputs for one step: `input_ids`/`position_ids` [1, N] packed over the sequences,
    the attention layout, and `last_index` [B], where each sequence's next-token logits are."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    arena_step: ArenaStep
    last_index: torch.Tensor


def pack_step(
    sequences: list[Sequence],
    arena: KVArena,
    device: torch.device | str,
    *,
    use_flash: bool,
    split_k: bool = False,
) -> PackedStep:
    """Lay out each sequence's uncached tokens after one another in a single row."""
    ids = []
    positions = []
    writes = []
    q_lens = []
    kv_lens = []
    starts = []
    cu_q = [0]
    for seq in sequences:
        assert seq.slot is not None
        new = seq.token_ids[seq.num_cached :]
        first = seq.num_cached
        offset = arena.offset(seq.slot)
        ids += new
        positions += range(first, first + len(new))
        writes += range(offset + first, offset + first + len(new))
        q_lens.append(len(new))
        kv_lens.append(first + len(new))
        starts.append(offset)
        cu_q.append(cu_q[-1] + len(new))
    step = ArenaStep.build(
        arena,
        write_index=_long(writes, device),
        q_lens=q_lens,
        kv_lens=kv_lens,
        kv_starts=starts,
        cu_q=cu_q,
        device=device,
        use_flash=use_flash,
        split_k=split_k,
    )
    return PackedStep(
        input_ids=_long(ids, device)[None],
        position_ids=_long(positions, device)[None],
        arena_step=step,
        last_index=_long([c - 1 for c in cu_q[1:]], device),
    )


def _long(values: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
