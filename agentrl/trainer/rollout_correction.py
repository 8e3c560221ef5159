"""Rollout correction: importance weights and rejection masks for the gap between the policy that
sampled the tokens (the engine's logprobs) and the trainer's policy before this step's update.

verl's `rollout_corr_helper` names (`rollout_is`, `rollout_rs`, thresholds, token veto) and levels
(token, sequence, geometric), slime's MIS levels, IcePop's two-sided token mask. Pure functions
over [B, T] tensors of packed rows; a level's sequence aggregates run over trained tokens only
(`Segments.seq_sum`), so tool output (loss_mask 0) never enters a sequence's weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from agentrl.config_correction import DEFAULT_IS_THRESHOLD, CorrectionSettings


class Segments(Protocol):
    """What a level reads of `losses.Segments` (which imports this module)."""

    loss_mask: Tensor  # [B, T] float
    seq_index: Tensor  # [B, T] long
    seq_num_tokens: Tensor  # [S] float, loss tokens per sequence

    def seq_sum(self, values: Tensor) -> Tensor: ...  # [B, T] -> [S], over loss tokens


SAFETY_BOUND = 20.0  # verl/slime: log ratios clamped to +-20 before exp


# ---------------------------------------------------------------- levels
# Every level: (log_ratio [B, T] = log pi_trainer - log pi_rollout, seg) -> the level's log ratio
# spread over each sequence's tokens [B, T]. Off the loss mask the values are meaningless.


def token_log_ratio(log_ratio: Tensor, seg: Segments) -> Tensor:
    """Each token its own ratio (biased, low variance)."""
    return log_ratio


def sequence_log_ratio(log_ratio: Tensor, seg: Segments) -> Tensor:
    """The product of a sequence's token ratios, sum of logs over its trained tokens (unbiased,
    high variance)."""
    return seg.seq_sum(log_ratio)[seg.seq_index]  # [S] -> [B, T]


def geometric_log_ratio(log_ratio: Tensor, seg: Segments) -> Tensor:
    """The geometric mean of a sequence's token ratios over its trained tokens (length-invariant)."""
    per_seq = seg.seq_sum(log_ratio) / seg.seq_num_tokens.clamp_min(1)  # [S]
    return per_seq[seg.seq_index]


LevelFn = Callable[[Tensor, Segments], Tensor]
LEVELS: dict[str, LevelFn] = {
    "token": token_log_ratio,
    "sequence": sequence_log_ratio,
    "geometric": geometric_log_ratio,
}


def _weights(level_log_ratio: Tensor) -> Tensor:
    return level_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()


# ---------------------------------------------------------------- the correction


@dataclass(frozen=True)
class CorrectionOutput:
    """What the correction gives one micro-batch, detached; off the loss mask nothing matters."""

    weights: Tensor  # [B, T] importance weight of each token's policy-gradient term (1: IS off)
    keep: Tensor  # [B, T] 0/1, 0 where rejection removed the token
    token_stats: dict[str, Tensor]  # [B, T] each, averaged over trained tokens
    seq_stats: dict[str, Tensor]  # [S] each, averaged over packed sequences
    max_stats: dict[str, Tensor]  # scalars, maxima over this micro-batch's trained tokens


ImportanceFn = Callable[[Tensor, Segments], tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]]
RejectionFn = Callable[[Tensor, Segments], Tensor]


def no_importance(
    log_ratio: Tensor, seg: Segments
) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """IS off: every weight 1, nothing to report."""
    return torch.ones_like(log_ratio), {}, {}


@dataclass(frozen=True)
class TruncatedImportance:
    """min(ratio at `level`, threshold): TIS at token level, verl's Seq-TIS, slime's geometric."""

    level: LevelFn
    threshold: float

    def __call__(
        self, log_ratio: Tensor, seg: Segments
    ) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
        raw = _weights(self.level(log_ratio, seg))  # [B, T]
        weights = raw.clamp(max=self.threshold)
        stats = {"tis_weight_mean": weights, "tis_clip_frac": (raw > self.threshold).to(raw.dtype)}
        return weights, stats, masked_max("tis_weight_max", raw, seg)  # max before truncation


@dataclass(frozen=True)
class LevelRejection:
    """Keep a token (token level) or a whole sequence when its ratio at `level` lies in
    [lower, upper] (verl's rollout_rs, slime's MIS mask mode, IcePop at token level)."""

    level: LevelFn
    lower: float
    upper: float

    def __call__(self, log_ratio: Tensor, seg: Segments) -> Tensor:
        level_weights = _weights(self.level(log_ratio, seg))  # [B, T]
        return ((level_weights >= self.lower) & (level_weights <= self.upper)).to(log_ratio.dtype)


@dataclass(frozen=True)
class TokenVeto:
    """Drop every token of a sequence holding a trained token whose ratio is below the
    threshold (verl's rollout_token_veto_threshold, slime's mis_veto_threshold)."""

    log_threshold: float

    def __call__(self, log_ratio: Tensor, seg: Segments) -> Tensor:
        is_catastrophic = (log_ratio < self.log_threshold) & (seg.loss_mask > 0)  # [B, T]
        is_vetoed = seg.seq_sum(is_catastrophic.to(log_ratio.dtype)) > 0  # [S]
        return (~is_vetoed[seg.seq_index]).to(log_ratio.dtype)


@dataclass(frozen=True)
class RolloutCorrection:
    """IS weights and a keep mask for one micro-batch, with their diagnostics. Its parts are
    chosen once from the settings (`build_correction`); the call branches on none of them."""

    importance: ImportanceFn
    rejections: tuple[RejectionFn, ...]  # a token is kept when every one keeps it

    def __call__(
        self, old_log_probs: Tensor, rollout_log_probs: Tensor, seg: Segments
    ) -> CorrectionOutput:
        log_ratio = (old_log_probs - rollout_log_probs).detach() * seg.loss_mask  # [B, T]
        weights, token_stats, max_stats = self.importance(log_ratio, seg)
        keep = torch.ones_like(log_ratio)
        for reject in self.rejections:
            keep = keep * reject(log_ratio, seg)
        token_stats["rs_masked_frac"] = 1.0 - keep
        seq_stats = {"rs_seq_masked_frac": (seg.seq_sum(1.0 - keep) > 0).to(keep.dtype)}
        return CorrectionOutput(weights, keep, token_stats, seq_stats, max_stats)


def build_correction(settings: CorrectionSettings) -> RolloutCorrection | None:
    """The correction the settings ask for; None when every part is off (metrics only)."""
    s = settings
    importance: ImportanceFn = no_importance
    if s.rollout_is is not None:
        importance = TruncatedImportance(LEVELS[s.rollout_is], s.rollout_is_threshold)
    rejections: list[RejectionFn] = []
    if s.rollout_rs is not None:
        upper = s.rollout_rs_threshold or DEFAULT_IS_THRESHOLD
        lower = s.rollout_rs_threshold_lower or 1.0 / upper
        rejections.append(LevelRejection(LEVELS[s.rollout_rs], lower, upper))
    if s.rollout_token_veto_threshold is not None:
        rejections.append(TokenVeto(math.log(s.rollout_token_veto_threshold)))
    if importance is no_importance and not rejections:
        return None
    return RolloutCorrection(importance, tuple(rejections))


def masked_max(name: str, values: Tensor, seg: Segments) -> dict[str, Tensor]:
    """`values`' max over the loss tokens [B, T] (none: no entry)."""
    is_loss = seg.loss_mask > 0
    return {name: values[is_loss].max()} if bool(is_loss.any()) else {}


# ---------------------------------------------------------------- mismatch metrics


def mismatch_stats(
    old_log_probs: Tensor, rollout_log_probs: Tensor, seg: Segments
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """KL(pi_rollout || pi_trainer) estimated on the rollout's tokens, per level: k1 =
    log pi_rollout - log pi_trainer, k3 = r - log r - 1 with r = pi_trainer / pi_rollout (verl's
    `kl` / `k3_kl`). Returns (per-token stats [B, T] to average over tokens, per-sequence stats
    [S] to average over sequences): `seq_*` sums a sequence's tokens, `geo_*` averages them."""
    log_ratio = (old_log_probs - rollout_log_probs).detach() * seg.loss_mask  # [B, T]
    k1 = -log_ratio
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    k3 = safe.exp() - safe - 1
    num_tokens = seg.seq_num_tokens.clamp_min(1)  # [S]
    # [S]
    k1_sum = seg.seq_sum(k1)
    k3_sum = seg.seq_sum(k3)
    per_token = {"mismatch_kl_k1": k1, "mismatch_kl_k3": k3}
    per_seq = {
        "mismatch_seq_kl_k1": k1_sum,
        "mismatch_seq_kl_k3": k3_sum,
        "mismatch_geo_kl_k1": k1_sum / num_tokens,
        "mismatch_geo_kl_k3": k3_sum / num_tokens,
    }
    return per_token, per_seq
