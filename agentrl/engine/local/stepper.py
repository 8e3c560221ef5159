"""One step of `LocalEngine`'s worker: schedule, run the model over every running sequence's uncached
tokens (eagerly, or as a CUDA-graph replay when the step only decodes), sample, check stops and
deliver the finished. A graph decode step is checked while the next one already runs on the GPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from agentrl.engine.local.batching import Sequence, StopChecker, pack_step
from agentrl.engine.local.cuda_graphs import DecodeGraphs, DecodeLaunch
from agentrl.engine.local.sampling import SamplingRows, sample
from agentrl.engine.local.scheduler import Scheduler

logger = logging.getLogger(__name__)

Forward = Callable[..., torch.Tensor]
"""(input_ids [1, N], position_ids [1, N], ArenaStep, last_index [B]) -> logits [B, V]."""


@dataclass
class EngineStats:
    """Counters kept by the worker; `max_running_batch_size` shows that requests were batched."""

    num_prefill_calls: int = 0
    num_decode_steps: int = 0
    num_generated_tokens: int = 0
    max_running_batch_size: int = 0
    num_prefill_tokens: int = 0
    """Tokens run through the model other than decode tokens (prompts, new multi-turn tails)."""
    num_cached_tokens: int = 0
    """Prompt tokens reused from a routing key's slot instead of prefilled."""
    num_graph_replays: int = 0
    num_run_ahead_steps: int = 0
    """Graph decode steps launched before the previous step's tokens were checked."""


@dataclass
class StepOptions:
    """How steps run: `use_flash` (FlashAttention over the arena), `split_k` (decode-only steps
    through the split-K kernel instead), `use_graphs` (decode under CUDA graphs), `compile_graphs`
    (their forward and sampler through torch.compile)."""

    device: str
    vocab_size: int
    max_batch_size: int
    use_flash: bool
    use_graphs: bool
    compile_graphs: bool = False
    split_k: bool = False


class Stepper:
    """The worker's step. `forward` runs the model; `packed` (CPU oneDNN linears) is active inside
    eager forwards; `deliver` hands a finished sequence back; `has_commands` says whether a command
    waits (then no step runs ahead)."""

    def __init__(
        self,
        scheduler: Scheduler,
        forward: Forward,
        options: StepOptions,
        stop_checker: StopChecker,
        *,
        deliver: Callable[[Sequence], None],
        has_commands: Callable[[], bool],
        packed: Any = None,
        set_compiled: Callable[[bool], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.forward = forward
        self.options = options
        self.stop_checker = stop_checker
        self.deliver = deliver
        self.has_commands = has_commands
        self.packed = packed
        self.set_compiled = set_compiled
        self.stats = EngineStats()
        self.graphs: DecodeGraphs | None = None
        self.in_flight: DecodeLaunch | None = None  # a graph decode step not yet checked

    def step(self) -> None:
        """Schedule (admit waiting requests into free slots) → run one forward over every running
        sequence's uncached tokens → sample, check stops, deliver the finished."""
        if self.in_flight is not None:
            self.check_decode()
            return
        batch = self.scheduler.schedule()
        if not batch:
            return
        self.stats.max_running_batch_size = max(self.stats.max_running_batch_size, len(batch))
        is_decode_only = all(s.num_tokens - s.num_cached == 1 and s.output_ids for s in batch)
        if is_decode_only and self._graphs_ready(len(batch)):
            assert self.graphs is not None
            self.in_flight = self.graphs.replay(batch, self.options.vocab_size)
            self.stats.num_graph_replays += 1
            self.check_decode()
            return
        ids, logprobs = self._forward_eager(batch)
        self._finish_step(batch, ids.tolist(), logprobs.tolist())

    def check_decode(self) -> None:
        """Step N is on the GPU: launch step N + 1 for the same rows when nothing can change the
        batch in between, then append and check N's tokens while N + 1 computes. A row that N
        finishes (a stop id or string) computed one token too many in N + 1: it is dropped."""
        assert self.graphs is not None and self.in_flight is not None
        current, self.in_flight = self.in_flight, None
        if self._can_run_ahead(current.batch):
            self.in_flight = self.graphs.replay_next(current.batch)
            self.stats.num_graph_replays += 1
            self.stats.num_run_ahead_steps += 1
        current.done.synchronize()
        alive = [i for i, s in enumerate(current.batch) if not (s.is_finished or s.is_cancelled)]
        ids = current.ids.tolist()
        logprobs = current.logprobs.tolist()
        self._finish_step(
            [current.batch[i] for i in alive], [ids[i] for i in alive], [logprobs[i] for i in alive]
        )

    def _can_run_ahead(self, batch: list[Sequence]) -> bool:
        """Step N + 1 may start before N's tokens are checked when its rows are N's: no command
        or admissible request waits, no row is done, and none can reach its length limit at N
        (its next K/V row would fall outside its slot)."""
        scheduler = self.scheduler
        limit = self.stop_checker.max_positions
        return (
            not self.has_commands()
            and not (scheduler.pending and len(scheduler.running) < self.options.max_batch_size)
            and len(batch) == len(scheduler.running)
            and all(
                not (s.is_finished or s.is_cancelled)
                and len(s.output_ids) + 1 < s.sampling.max_new_tokens
                and s.num_tokens + 1 < limit
                for s in batch
            )
        )

    def _finish_step(self, batch: list[Sequence], ids: list[int], logprobs: list[float]) -> None:
        self._count_step(batch, [s.num_tokens - s.num_cached for s in batch])
        for seq in batch:
            seq.num_cached = seq.num_tokens
        for seq, token_id, logprob in zip(batch, ids, logprobs, strict=True):
            seq.output_ids.append(token_id)
            seq.output_logprobs.append(logprob)
            self.stop_checker.check(seq)
        self.stats.num_generated_tokens += len(ids)
        for seq in self.scheduler.retire():
            self.deliver(seq)

    def _graphs_ready(self, batch_size: int) -> bool:
        if not self.options.use_graphs:
            return False
        if self.graphs is None:
            self.graphs = self._capture()
            if self.graphs is None:
                self.options.use_graphs = False
                return False
        return batch_size <= self.graphs.max_batch_size

    def _capture(self) -> DecodeGraphs | None:
        """Capture the decode graphs; compiled first when asked (the forward as the engine set it
        up), then with everything eager if that fails."""
        o = self.options
        arena = self.scheduler.arena
        for compiled in [True, False] if o.compile_graphs else [False]:
            if not compiled and self.set_compiled is not None:
                self.set_compiled(False)
            try:
                return DecodeGraphs.capture(
                    self.forward,
                    arena,
                    o.device,
                    o.max_batch_size,
                    o.vocab_size,
                    compile_sampler=compiled,
                    split_k=o.split_k,
                )
            except Exception:  # eager graphs, or eager decode, stay correct, only slower
                what = "compiled" if compiled else "eager"
                logger.exception("LocalEngine: %s CUDA graph capture failed", what)
                with contextlib.suppress(Exception):  # a broken capture may fail this too
                    torch.cuda.synchronize(o.device)
        o.compile_graphs = False
        return None

    @torch.inference_mode()
    def _forward_eager(self, batch: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        arena = self.scheduler.arena
        o = self.options
        step = pack_step(batch, arena, o.device, use_flash=o.use_flash, split_k=o.split_k)
        if not self.options.use_flash:
            for seq in batch:
                assert seq.slot is not None
                arena.ensure_clean(seq.slot, step.arena_step.max_k)
        with self.packed.active() if self.packed else contextlib.nullcontext():
            logits = self.forward(
                step.input_ids, step.position_ids, step.arena_step, step.last_index
            )
        rows = SamplingRows.empty(len(batch), self.options.device)
        rows.fill([s.sampling_row() for s in batch], self.options.vocab_size)
        return sample(
            logits,
            rows,
            use_filter=any(s.sampling.top_k > 0 or s.sampling.top_p < 1 for s in batch),
            use_noise=any(s.sampling.temperature > 0 for s in batch),
        )

    def _count_step(self, batch: list[Sequence], num_new: list[int]) -> None:
        prefilled = [n for s, n in zip(batch, num_new, strict=True) if not s.output_ids]
        if prefilled:
            self.stats.num_prefill_calls += 1
            self.stats.num_prefill_tokens += sum(prefilled)
            self.stats.num_cached_tokens += sum(s.num_cached for s in batch if not s.output_ids)
        if len(prefilled) < len(batch):
            self.stats.num_decode_steps += 1

    def fail_running(
        self, error: Exception, resolve: Callable[[Sequence, Exception], None]
    ) -> None:
        self.in_flight = None
        for seq in self.scheduler.running:
            self.scheduler.release_slot(seq, keep=False)
            resolve(seq, error)
        self.scheduler.running = []
