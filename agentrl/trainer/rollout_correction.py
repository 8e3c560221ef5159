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
class RolloutCorrection:
    """IS weights and a keep mask for one micro-batch, with its per-token diagnostics.

    Chosen once from the settings (`build_correction`): a level off is a function that returns
    ones, so the call below has no branch on the configuration."""

    is_level: LevelFn | None
    is_threshold: float
    rs_level: LevelFn | None
    rs_lower: float
    rs_upper: float
    log_veto_threshold: float | None

    def __call__(
        self, old_log_probs: Tensor, rollout_log_probs: Tensor, seg: Segments
    ) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Tensor]]:
        """(IS weights [B, T], keep mask [B, T] 0/1, per-token stats [B, T], per-sequence stats
        [S]), all detached. Off the loss mask the values mean nothing (the loss mask zeroes them)."""
        log_ratio = (old_log_probs - rollout_log_probs).detach() * seg.loss_mask  # [B, T]
        stats: dict[str, Tensor] = {}
        seq_stats: dict[str, Tensor] = {}
        ones = torch.ones_like(log_ratio)
        weights = ones
        if self.is_level is not None:
            raw = _weights(self.is_level(log_ratio, seg))  # [B, T]
            weights = raw.clamp(max=self.is_threshold)
            stats["tis_weight_mean"] = weights
            stats["tis_clip_frac"] = (raw > self.is_threshold).to(raw.dtype)
            stats["tis_weight_max_raw"] = raw  # reduced as a max, not a mean
        keep = ones
        if self.rs_level is not None:
            level_weights = _weights(self.rs_level(log_ratio, seg))
            keep = ((level_weights >= self.rs_lower) & (level_weights <= self.rs_upper)).to(
                log_ratio.dtype
            )
        if self.log_veto_threshold is not None:
            is_catastrophic = (log_ratio < self.log_veto_threshold) & (seg.loss_mask > 0)
            seq_vetoed = seg.seq_sum(is_catastrophic.to(log_ratio.dtype)) > 0  # [S]
            keep = keep * (~seq_vetoed[seg.seq_index]).to(log_ratio.dtype)
        if self.rs_level is not None or self.log_veto_threshold is not None:
            stats["rs_masked_frac"] = 1.0 - keep
            seq_stats["rs_seq_masked_frac"] = (seg.seq_sum(1.0 - keep) > 0).to(keep.dtype)
        return weights, keep, stats, seq_stats


def build_correction(settings: CorrectionSettings) -> RolloutCorrection | None:
    """The correction the settings ask for; None when every part is off (metrics only)."""
    s = settings
    if s.rollout_is is None and s.rollout_rs is None and s.rollout_token_veto_threshold is None:
        return None
    upper = s.rollout_rs_threshold or DEFAULT_IS_THRESHOLD
    lower = s.rollout_rs_threshold_lower or 1.0 / upper
    veto = s.rollout_token_veto_threshold
    return RolloutCorrection(
        is_level=LEVELS[s.rollout_is] if s.rollout_is else None,
        is_threshold=s.rollout_is_threshold,
        rs_level=LEVELS[s.rollout_rs] if s.rollout_rs else None,
        rs_lower=lower,
        rs_upper=upper,
        log_veto_threshold=math.log(veto) if veto is not None else None,
    )


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
    k1_sum, k3_sum = seg.seq_sum(k1), seg.seq_sum(k3)  # [S]
    per_token = {"mismatch_kl_k1": k1, "mismatch_kl_k3": k3}
    per_seq = {
        "mismatch_seq_kl_k1": k1_sum,
        "mismatch_seq_kl_k3": k3_sum,
        "mismatch_geo_kl_k1": k1_sum / num_tokens,
        "mismatch_geo_kl_k3": k3_sum / num_tokens,
    }
    return per_token, per_seq
