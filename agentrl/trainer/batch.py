"""Groups of trajectories to a `TrainBatch`: advantages, group filtering, shifted per-token
tensors, and first-fit-decreasing packing of sequences into micro-batches under a token budget."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from agentrl.config import AlgoConfig
from agentrl.trainer.losses import ADVANTAGE_ESTIMATORS, LossInputs, Segments
from agentrl.trainer.sampling_mask import OFF_TOP_K, OFF_TOP_P
from agentrl.types import EpisodeStatus, Group, Trajectory, Turn


def to_device(tensor: Tensor, device: torch.device | str) -> Tensor:
    """`tensor` on `device`. A CPU tensor goes to a GPU through pinned memory without blocking:
    a copy from pageable memory waits for the GPU's queue to drain, so a copy before each
    micro-batch would leave the GPU idle while the CPU launches the next forward."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass
class MicroBatch:
    """One forward/backward pass. Position t holds the logprob of token t+1 (the target)."""

    input_ids: Tensor  # [R, T] long
    position_ids: Tensor  # [R, T] long, restarting at 0 for every packed sequence
    target_ids: Tensor  # [R, T] long, input_ids shifted left by one within each sequence
    loss_mask: Tensor  # [R, T] float, 1 where target_ids[t] was sampled by the policy
    advantages: Tensor  # [R, T] float, the sequence advantage on every token (0 off the mask)
    rollout_logprobs: Tensor  # [R, T] float, engine logprob of target_ids[t] (0 off the mask)
    seq_index: Tensor  # [R, T] long, which sequence of this micro-batch a token belongs to
    seq_num_tokens: Tensor  # [S] float, loss tokens per sequence
    sample_indices: list[int]  # index of each sequence in TrainBatch order (trainable ones only)
    old_logprobs: Tensor | None = None  # [R, T], set by TorchBackend.compute_logprobs
    ref_logprobs: Tensor | None = None  # [R, T], set when a reference model is loaded
    top_k: Tensor | None = None  # [R, T] long, top-k of the turn that sampled target t (-1: off)
    top_p: Tensor | None = None  # [R, T] float, its top-p (1: off); both None: no replay

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {k: to_device(v, device) for k, v in vars(self).items() if isinstance(v, Tensor)}
        return replace(self, **moved)

    def loss_inputs(self, num_tokens: float, num_seqs: float, old_logprobs: Tensor) -> LossInputs:
        seg = Segments(self.loss_mask, self.seq_index, self.seq_num_tokens, num_tokens, num_seqs)
        return LossInputs(
            seg, self.advantages, old_logprobs, self.rollout_logprobs, self.ref_logprobs
        )


@dataclass
class StepBatch:
    """The micro-batches of one optimizer step and that step's global loss denominators."""

    micro_batches: list[MicroBatch]
    num_loss_tokens: int
    num_seqs: int


@dataclass
class TrainBatch:
    steps: list[StepBatch]
    metrics: dict[str, float] = field(default_factory=dict)
    max_abs_advantage: float = math.inf
    """Over every rank's sequences (so all ranks agree): 0 means no policy-gradient signal, as
    when every group's rewards were equal. inf = unknown, treated as a signal."""

    def micro_batches(self) -> Iterator[MicroBatch]:
        for step in self.steps:
            yield from step.micro_batches


def pad_id_for(config: Any) -> int:
    """The id padding uses (masked out of every loss, so any valid id works): a model config's
    pad, else its (first) eos, else 0."""
    for candidate in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


# ---------------------------------------------------------------- advantages and filtering


def compute_advantages(groups: Sequence[Group], algo_cfg: AlgoConfig) -> list[list[float | None]]:
    """One advantage per trajectory (None for ERROR/ABORTED ones, which never enter the statistics).

    An episode recorded as several segments (an agent that rewrote its history: same
    `episode_id`, same reward) counts once in its group's statistics, with the tokens of all its
    segments, and each segment gets the episode's advantage."""
    estimator = ADVANTAGE_ESTIMATORS[algo_cfg.advantage_estimator]  # a Literal of AlgoConfig
    episodes: dict[tuple[int, str], list[int]] = {}  # (group, episode) -> its segments' indices
    for g, group in enumerate(groups):
        for i, t in enumerate(group):
            if EpisodeStatus(t.status).is_trainable:
                episode = t.episode_id or f"#{i}"  # no id: its own episode
                episodes.setdefault((g, episode), []).append(i)
    out: list[list[float | None]] = [[None] * len(group) for group in groups]
    if not episodes:
        return out
    keys = list(episodes)
    rewards = torch.tensor(
        [float(groups[g][episodes[g, e][0]].reward) for g, e in keys], dtype=torch.float64
    )
    group_ids = torch.tensor([g for g, _ in keys], dtype=torch.long)
    num_tokens = torch.tensor(
        [sum(sum(groups[g][i].loss_mask) for i in episodes[g, e]) for g, e in keys],
        dtype=torch.float64,
    )
    advantages = estimator(rewards, group_ids, num_tokens, algo_cfg)
    for (g, e), a in zip(keys, advantages.tolist(), strict=True):
        for i in episodes[g, e]:
            out[g][i] = a
    return out


# ---------------------------------------------------------------- per-sequence arrays


@dataclass
class _Sample:
    """One trajectory cut after its last sampled token, already shifted by one."""

    index: int
    input_ids: list[int]
    target_ids: list[int]
    loss_mask: list[float]
    rollout_logprobs: list[float]
    advantage: float
    top_k: list[int] | None = None  # per target; None: no turn of it reported truncated logprobs
    top_p: list[float] | None = None

    @property
    def length(self) -> int:
        return len(self.input_ids)


def _make_sample(index: int, traj: Trajectory, advantage: float, pad_id: int) -> _Sample | None:
    ids = list(traj.token_ids)
    mask = [int(m) for m in traj.loss_mask]
    if len(mask) != len(ids) or sum(mask) != len(traj.logprobs):
        raise ValueError(
            f"trajectory {traj.episode_id or index!r}: {len(ids)} token ids, {len(mask)} mask "
            f"entries, {sum(mask)} trained tokens but {len(traj.logprobs)} logprobs; they must agree "
            "(Trajectory.check() names the broken invariant)"
        )
    if not any(mask):
        return None
    if mask[0]:
        raise ValueError(
            f"trajectory {traj.episode_id or index!r}: the first token cannot be trained"
        )
    it = iter(traj.logprobs)  # one per sampled token: spread over the positions
    dense = [float(next(it)) if m else 0.0 for m in mask]
    # Tokens after the last sampled one cannot change any trained logprob: cut them.
    end = max(t for t, m in enumerate(mask) if m) + 1
    sample = _Sample(
        index=index,
        input_ids=ids[:end],
        target_ids=ids[1:end] + [pad_id],
        loss_mask=[float(m) for m in mask[1:end]] + [0.0],
        rollout_logprobs=dense[1:end] + [0.0],
        advantage=advantage,
    )
    return _with_sampling_masks(sample, traj.turns)


def _with_sampling_masks(sample: _Sample, turns: Sequence[Turn]) -> _Sample:
    masks = sampling_masks(turns, sample.length)
    return sample if masks is None else replace(sample, top_k=masks[0], top_p=masks[1])


def sampling_masks(turns: Sequence[Turn], length: int) -> tuple[list[int], list[float]] | None:
    """The top-k / top-p of each of `length` targets (position t predicts token t + 1) sampled by
    a turn whose engine reported logprobs of the truncated distribution
    (`Turn.is_logprob_truncated`): the trainer replays that filter. None: no turn did."""
    replayed = [t for t in turns if t.is_logprob_truncated]
    if not replayed:
        return None
    top_k = [OFF_TOP_K] * length
    top_p = [OFF_TOP_P] * length
    for turn in replayed:
        for t in range(turn.start, min(turn.start + turn.num_sampled, length + 1)):
            top_k[t - 1] = int(turn.top_k)
            top_p[t - 1] = float(turn.top_p)
    return top_k, top_p


# ---------------------------------------------------------------- packing


def pack_first_fit_decreasing(
    lengths: list[int], budget: int, *, max_seqs: int | None = None
) -> list[list[int]]:
    """Indices grouped into micro-batches of at most `budget` tokens in all (a longer sequence
    sits alone) and at most `max_seqs` sequences (None = no bound)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        for b, members in enumerate(bins):
            if used[b] + lengths[i] <= budget and (max_seqs is None or len(members) < max_seqs):
                members.append(i)
                used[b] += lengths[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    return bins


def _packed_row(samples: list[_Sample]) -> MicroBatch:
    """Concatenate samples into one packed row."""

    def row(values: Callable[[int, _Sample], list[Any]], dtype: torch.dtype) -> Tensor:
        return torch.tensor([[x for k, s in enumerate(samples) for x in values(k, s)]], dtype=dtype)

    return MicroBatch(
        input_ids=row(lambda k, s: s.input_ids, torch.long),
        position_ids=row(lambda k, s: list(range(s.length)), torch.long),
        target_ids=row(lambda k, s: s.target_ids, torch.long),
        loss_mask=row(lambda k, s: s.loss_mask, torch.float32),
        advantages=row(lambda k, s: [s.advantage * m for m in s.loss_mask], torch.float32),
        rollout_logprobs=row(lambda k, s: s.rollout_logprobs, torch.float32),
        seq_index=row(lambda k, s: [k] * s.length, torch.long),
        seq_num_tokens=torch.tensor([sum(s.loss_mask) for s in samples], dtype=torch.float32),
        sample_indices=[s.index for s in samples],
        **_sampling_mask_rows(samples),
    )


def _sampling_mask_rows(samples: list[_Sample]) -> dict[str, Tensor]:
    """top_k / top_p rows [1, T] when a sample replays a sampling mask; none otherwise (no cost)."""
    if all(s.top_k is None for s in samples):
        return {}
    top_k = [k for s in samples for k in (s.top_k or [OFF_TOP_K] * s.length)]
    top_p = [p for s in samples for p in (s.top_p or [OFF_TOP_P] * s.length)]
    return {
        "top_k": torch.tensor([top_k], dtype=torch.long),
        "top_p": torch.tensor([top_p], dtype=torch.float32),
    }


def _empty_micro_batch(pad_id: int) -> MicroBatch:
    """One pad token, nothing trained: it keeps a rank with less data in step with the others'
    forward/backward collectives, and adds exactly zero to the loss and the gradients. It is
    one empty sequence (seq_num_tokens [0]), so seq_index 0 stays in range."""
    pad = _Sample(-1, [pad_id], [pad_id], loss_mask=[0.0], rollout_logprobs=[0.0], advantage=0.0)
    return replace(_packed_row([pad]), sample_indices=[])


def split_balanced(lengths: list[int], num_parts: int) -> list[list[int]]:
    """Indices split into `num_parts` lists of similar total length: longest first onto the part
    with the fewest tokens so far (ties: the lowest part). Each list keeps ascending order."""
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    totals = [0] * num_parts
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        p = min(range(num_parts), key=lambda p: totals[p])
        parts[p].append(i)
        totals[p] += lengths[i]
    return [sorted(part) for part in parts]


def _step_batches(
    samples: list[_Sample],
    budget: int,
    pad_id: int,
    dp_size: int,
    max_seqs: int | None,
    *,
    is_advantage_only: bool = False,
) -> list[StepBatch]:
    """One optimizer step as `dp_size` StepBatches (one per rank) with the step's global loss
    denominators and equal micro-batch counts (padded with empty micro-batches).

    `is_advantage_only` (every loss term is scaled by the advantage: no KL, no entropy): a
    sequence with advantage 0 adds exactly 0 to the loss and the gradient, so it is not packed
    at all; it still counts in the denominators, so the update is the one it would have been."""
    trained = [s for s in samples if s.advantage != 0.0] if is_advantage_only else samples
    per_rank: list[list[MicroBatch]] = []
    for part in split_balanced([s.length for s in trained], dp_size):
        mine = [trained[i] for i in part]
        bins = pack_first_fit_decreasing([s.length for s in mine], budget, max_seqs=max_seqs)
        per_rank.append([_packed_row([mine[i] for i in members]) for members in bins])
    num_micro = max((len(mbs) for mbs in per_rank), default=0)
    num_loss_tokens = int(sum(sum(s.loss_mask) for s in samples))
    return [
        StepBatch(
            mbs + [_empty_micro_batch(pad_id) for _ in range(num_micro - len(mbs))],
            num_loss_tokens=num_loss_tokens,
            num_seqs=len(samples),
        )
        for mbs in per_rank
    ]


# ---------------------------------------------------------------- the batch


def build_train_batches(
    groups: Sequence[Group],
    algo_cfg: AlgoConfig,
    *,
    max_tokens_per_micro_batch: int,
    pad_id: int,
    global_batch_size: int | None = None,
    dp_size: int = 1,
    micro_batch_size: int | None = None,
) -> list[TrainBatch]:
    """One `TrainBatch` per data-parallel rank. Advantages over all groups, then trainable
    trajectories split into optimizer steps of `global_batch_size` (in order; None = one step);
    each step's sequences split over the ranks balanced by tokens and packed into micro-batches
    of at most `max_tokens_per_micro_batch` tokens and `micro_batch_size` sequences (None = as
    many as fit). Without a KL or entropy term, sequences with advantage 0 (e.g. every one of a
    group whose rewards tie) cost no forward or backward pass: they are left out of the
    micro-batches but kept in the denominators. Every rank gets the same number of steps and
    of micro-batches per step, and each step's global denominators, so summing the ranks'
    gradients gives the 1-rank update. ERROR/ABORTED trajectories are counted and left out."""
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1 (the number of trainer ranks)")
    advantages = compute_advantages(groups, algo_cfg)
    trajs = [t for group in groups for t in group]
    flat_adv = [a for group_adv in advantages for a in group_adv]
    pairs = zip(trajs, flat_adv, strict=True)
    made = [_make_sample(k, t, a, pad_id) for k, (t, a) in enumerate(pairs) if a is not None]
    samples = [s for s in made if s is not None]
    num_no_loss = len(made) - len(samples)
    for i, s in enumerate(samples):
        s.index = i  # position among trained sequences, as MicroBatch.sample_indices reports it
    step_size = global_batch_size or max(len(samples), 1)
    is_advantage_only = not has_advantage_free_term(algo_cfg)
    steps = [  # [step][rank]
        _step_batches(
            samples[i : i + step_size],
            max_tokens_per_micro_batch,
            pad_id,
            dp_size,
            micro_batch_size,
            is_advantage_only=is_advantage_only,
        )
        for i in range(0, len(samples), step_size)
    ]
    metrics = _batch_metrics(trajs, samples, steps, max_tokens_per_micro_batch, num_no_loss)
    packed = [s for s in samples if s.advantage != 0.0] if is_advantage_only else samples
    metrics["batch/num_zero_advantage_skipped"] = float(len(samples) - len(packed))
    metrics["batch/num_packed_tokens"] = float(sum(s.length for s in packed))  # the work
    max_abs_advantage = max((abs(s.advantage) for s in samples), default=0.0)
    return [
        TrainBatch(
            steps=[step[rank] for step in steps],
            metrics=metrics,
            max_abs_advantage=max_abs_advantage,
        )
        for rank in range(dp_size)
    ]


def has_advantage_free_term(algo_cfg: AlgoConfig) -> bool:
    """A KL or entropy term pulls on every trained token, whatever its advantage."""
    return (algo_cfg.use_kl_loss and algo_cfg.kl_loss_coef > 0) or bool(algo_cfg.entropy_coef)


def _batch_metrics(
    trajs: list[Trajectory],
    samples: list[_Sample],
    steps: list[list[StepBatch]],
    budget: int,
    num_no_loss: int,
) -> dict[str, float]:
    """Over the whole batch, all ranks together; empty (rank-padding) micro-batches apart."""
    statuses = [EpisodeStatus(t.status) for t in trajs]
    all_micro = [mb for step in steps for rank in step for mb in rank.micro_batches]
    micro = [mb for mb in all_micro if mb.sample_indices]
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
    return {
        "batch/num_trajectories": float(len(trajs)),
        "batch/num_trained_sequences": float(len(samples)),
        "batch/num_excluded_error": float(sum(s == EpisodeStatus.ERROR for s in statuses)),
        "batch/num_excluded_aborted": float(sum(s == EpisodeStatus.ABORTED for s in statuses)),
        "batch/num_without_loss_tokens": float(num_no_loss),
        "batch/num_loss_tokens": float(sum(step[0].num_loss_tokens for step in steps)),
        "batch/num_tokens": float(sum(s.length for s in samples)),
        "batch/num_micro_batches": float(len(micro)),
        "batch/num_empty_micro_batches": float(len(all_micro) - len(micro)),
        "batch/num_optimizer_steps": float(len(steps)),
        "batch/num_oversized": float(sum(s.length > budget for s in samples)),
        "batch/advantage_mean": float(adv.mean()) if len(samples) else 0.0,
        "batch/advantage_abs_mean": float(adv.abs().mean()) if len(samples) else 0.0,
    }
