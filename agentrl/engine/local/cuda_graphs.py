"""Decode under CUDA graphs: per batch-size bucket one captured graph of the model's forward over
the KV arena plus the sampler, replayed for steps in which every running sequence feeds one token.

A graph reads static input buffers, so a step only copies its rows in (three host-to-device copies)
and replays; rows past the real batch point at the arena's scratch slot. Weight updates copy into
the same parameter storage and keep the graphs valid; after the weights or the arena move
(`release_memory` / `resume_memory`) the engine captures them again. `replay_next` launches the
following step from the device-side results, so the host checks step N's tokens while N + 1 runs.

The forward handed in may be compiled (`torch.compile`, default mode: it makes no graphs of its
own); with `compile_sampler` the sampler is compiled too (its Gumbel noise, scaling and logsumexp
become a few fused kernels instead of dozens over [B, V]), its top-k/top-p by radix select instead
of a sort of [B, V]. Compilation happens in the warm-up runs
before capture, so the capture records only the generated kernels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentrl.engine.local.attention import ArenaStep
from agentrl.engine.local.batching import Sequence
from agentrl.engine.local.kv_arena import KVArena
from agentrl.engine.local.sampling import SamplingRows, sample, vocab_terms

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
_INT_ROWS = ("input_ids", "positions", "write_index", "top_k", "seed", "sample_position")


def buckets_up_to(max_batch_size: int) -> list[int]:
    return [b for b in BUCKETS if b < max_batch_size] + [max_batch_size]


@dataclass
class DecodeLaunch:
    """A decode step on its way: its rows, and where their sampled ids and logprobs land in host
    memory once `done` has completed."""

    batch: list[Sequence]
    ids: torch.Tensor
    logprobs: torch.Tensor
    done: torch.cuda.Event


class DecodeGraphs:
    """Two CUDA graphs per bucket (with and without the top-k/top-p filter, whose sort costs a
    step's worth of small kernels), sharing a memory pool and the static buffers."""

    def __init__(
        self, arena: KVArena, device: str, max_batch_size: int, split_k: bool = False
    ) -> None:
        n = max_batch_size
        self.arena = arena
        self.max_batch_size = max_batch_size
        self.split_k = split_k  # attention through the split-K decode kernel
        self.buckets = buckets_up_to(max_batch_size)
        self.ints = torch.zeros(len(_INT_ROWS), n, dtype=torch.long, device=device)
        self.kv = torch.ones(2, n + 1, dtype=torch.int32, device=device)  # starts, lengths
        self.floats = torch.ones(2, n, device=device)  # temperature, top_p
        self.cu_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(n, device=device)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        # Two launches may be in flight (step N being checked while N + 1 computes): one pinned
        # host buffer each, taken in turn.
        self._host_ids = torch.zeros(2, n, dtype=torch.long, pin_memory=True)
        self._host_logprobs = torch.zeros(2, n, pin_memory=True)
        self._turn = 0
        self._last = (self.buckets[0], False)  # the bucket and filter of the last replay
        self._sample: Callable[..., tuple[torch.Tensor, torch.Tensor]] = sample
        self._terms: torch.Tensor | None = None  # the noise's per-id terms, made at capture
        self._eager_sampling: set[bool] = set()  # filter variants whose compiled sampler failed

    @classmethod
    def capture(
        cls,
        forward: Callable[..., torch.Tensor],
        arena: KVArena,
        device: str,
        max_batch_size: int,
        num_vocab: int,
        *,
        compile_sampler: bool = False,
        split_k: bool = False,
    ) -> DecodeGraphs:
        """`forward(input_ids, position_ids, arena_step, last_index)` -> logits [B, V];
        `split_k`: attention through the split-K decode kernel."""
        self = cls(arena, device, max_batch_size, split_k)
        self._sample = torch.compile(sample, fullgraph=True) if compile_sampler else sample
        self._terms = vocab_terms(num_vocab, device)
        self._fill_padding(0, max_batch_size, num_vocab)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)
        for b in reversed(self.buckets):  # largest first: smaller graphs reuse its pool blocks
            for use_filter in (True, False):
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(2):  # warm-up: cuBLAS handles, lazy inits, autotuning
                        self._forward(forward, b, use_filter)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # cuBLAS keeps one workspace per stream, and every capture runs on torch's one
                # capture stream: uncleared, this graph would bake in the workspace an earlier
                # capture (another engine's, since closed) took from its own pool, and a replay
                # after that pool was freed (a release clears workspaces and empties the cache)
                # wrote into memory given back to the driver: an illegal memory access. Cleared
                # before, the workspace comes from this engine's pool, which lives as long as its
                # graphs; cleared after, no matmul outside them uses it (as inductor does).
                torch._C._cuda_clearCublasWorkspaces()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(forward, b, use_filter)
                torch._C._cuda_clearCublasWorkspaces()
                self.graphs[b, use_filter] = graph
        torch.cuda.synchronize(device)
        return self

    @torch.inference_mode()
    def _forward(self, forward: Callable[..., torch.Tensor], b: int, use_filter: bool) -> None:
        row = dict(zip(_INT_ROWS, self.ints, strict=True))
        step = ArenaStep(
            self.arena.keys,
            self.arena.values,
            row["write_index"][:b],
            use_flash=True,
            max_q=1,
            max_k=self.arena.max_len,
            cu_q=self.cu_q[: b + 1],
            cu_k=self.kv[0, : b + 1],
            seqused_k=self.kv[1, :b],
            split_k=self.split_k,
        )
        logits = forward(row["input_ids"][None, :b], row["positions"][None, :b], step, None)
        rows = SamplingRows(
            self.floats[0, :b],
            self.floats[1, :b],
            row["top_k"][:b],
            row["seed"][:b],
            row["sample_position"][:b],
        )
        ids, logprobs = self._sample_rows(logits, rows, use_filter)
        self.ids[:b].copy_(ids)
        self.logprobs[:b].copy_(logprobs)

    def _sample_rows(
        self, logits: torch.Tensor, rows: SamplingRows, use_filter: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._sample is not sample and use_filter not in self._eager_sampling:
            for t in (logits, *vars(rows).values()):  # one compiled graph for every bucket > 1
                torch._dynamo.maybe_mark_dynamic(t, 0)
            try:  # compiled, top-k/top-p by radix select (no sort)
                return self._sample(
                    logits, rows, use_filter=use_filter, terms=self._terms, radix_filter=True
                )
            except torch.OutOfMemoryError:
                raise
            except Exception:  # found in the warm-up runs, before any capture
                logger.exception(
                    "LocalEngine: compiled sampler (filter %s) failed; eager", use_filter
                )
                self._eager_sampling.add(use_filter)  # the other graphs keep theirs
        return sample(logits, rows, use_filter=use_filter, terms=self._terms)

    def replay(self, batch: list[Sequence], num_vocab: int) -> DecodeLaunch:
        """Launch one decode step for `batch` (each row feeding its last sampled token); the
        sampled ids and logprobs arrive in host memory when the returned launch is `done`."""
        n = len(batch)
        b = next(b for b in self.buckets if b >= n)
        ints = []
        kv = []
        floats = []
        use_filter = False
        for seq in batch:
            assert seq.slot is not None
            start = self.arena.offset(seq.slot)
            temperature, top_p, top_k, seed, sample_position = seq.sampling_row()
            ints.append(
                (
                    seq.output_ids[-1],
                    seq.num_cached,
                    start + seq.num_cached,
                    num_vocab if top_k < 0 else top_k,
                    seed,
                    sample_position,
                )
            )
            kv.append((start, seq.num_cached + 1))
            floats.append((temperature, top_p))
            use_filter = use_filter or top_k > 0 or top_p < 1.0
        self.ints[:, :n].copy_(torch.tensor(ints).T, non_blocking=True)
        self.kv[:, :n].copy_(torch.tensor(kv, dtype=torch.int32).T, non_blocking=True)
        self.floats[:, :n].copy_(torch.tensor(floats).T, non_blocking=True)
        self._fill_padding(n, b, num_vocab)
        self._last = (b, use_filter)
        return self._launch(batch)

    def replay_next(self, batch: list[Sequence]) -> DecodeLaunch:
        """Launch the step after the last one for the same rows, without waiting for its tokens:
        on the device each row takes the id it just sampled as input and moves one position on
        (what `replay` would lay out once the host had appended that id). The caller makes sure
        no row can run past its slot (no row finishes by length at the last step)."""
        n = len(batch)
        self.ints[0, :n].copy_(self.ids[:n])
        self.ints[1:3, :n] += 1  # position, write row
        self.ints[5, :n] += 1  # sample position
        self.kv[1, :n] += 1  # K/V length
        return self._launch(batch)

    def _launch(self, batch: list[Sequence]) -> DecodeLaunch:
        n = len(batch)
        (b, use_filter) = self._last
        self.graphs[b, use_filter].replay()
        self._turn ^= 1
        ids = self._host_ids[self._turn, :n]
        logprobs = self._host_logprobs[self._turn, :n]
        ids.copy_(self.ids[:n], non_blocking=True)
        logprobs.copy_(self.logprobs[:n], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return DecodeLaunch(batch, ids, logprobs, done)

    def _fill_padding(self, start: int, end: int, num_vocab: int) -> None:
        """Rows [start, end) decode a dummy token into the scratch slot, greedily."""
        if start >= end:
            return
        scratch = self.arena.offset(self.arena.scratch_slot)
        # Scalar fills only: a copy from a host tensor here would wait for the GPU (a sync).
        for row, value in enumerate((0, 0, scratch, num_vocab, 0, 0)):
            self.ints[row, start:end].fill_(value)
        self.kv[0, start:end].fill_(scratch)
        self.kv[1, start:end].fill_(1)
        self.floats[0, start:end].fill_(0.0)
        self.floats[1, start:end].fill_(1.0)
