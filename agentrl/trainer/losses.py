"""Pure advantage estimators, policy losses, KL terms and loss aggregation (slime/verl definitions).

Variants are sibling functions in name -> function tables; `build_objective(algo_cfg)` picks them
once. Token tensors are [B, T]; a packed row holds several sequences, told apart by `seq_index`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from agentrl.config import AlgoConfig
from agentrl.config_correction import settings_from_config
from agentrl.trainer.rollout_correction import RolloutCorrection, build_correction, mismatch_stats

logger = logging.getLogger(__name__)
GRPO_EPS = 1e-6  # verl/slime: std + eps in the GRPO denominator
WHITEN_EPS = 1e-8  # verl masked_whiten: rsqrt(var + eps)
LOG_RATIO_CLAMP = 20.0  # verl clamps log(pi/pi_old) before exp for stability

# ---------------------------------------------------------------- advantages
# Every estimator: (rewards [N], group_ids [N] long, num_tokens [N], cfg) -> advantages [N].
# Only trainable trajectories are passed in, so ERROR/ABORTED ones never shift a baseline.


def _group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-trajectory group mean, unbiased group std and group size, each [N]."""
    num_groups = int(group_ids.max().item()) + 1 if group_ids.numel() else 0
    size = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(
        0, group_ids, torch.ones_like(rewards)
    )
    total = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, group_ids, rewards)
    mean = total / size.clamp_min(1)
    sq = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(
        0, group_ids, (rewards - mean[group_ids]) ** 2
    )
    std = (sq / (size - 1).clamp_min(1)).sqrt()
    return mean[group_ids], std[group_ids], size[group_ids]


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, num_tokens: Tensor, cfg: AlgoConfig
) -> Tensor:
    """(r - group mean) / (group std + eps); without std normalisation this is Dr. GRPO.
    A group of one keeps its raw reward (verl: mean 0, std 1)."""
    mean, std, size = _group_stats(rewards, group_ids)
    single = size < 2
    mean = torch.where(single, torch.zeros_like(mean), mean)
    centered = rewards - mean
    if not cfg.normalize_advantage_std:
        return centered
    std = torch.where(single, torch.ones_like(std), std)
    return centered / (std + GRPO_EPS)


def rloo_advantages(
    rewards: Tensor, group_ids: Tensor, num_tokens: Tensor, cfg: AlgoConfig
) -> Tensor:
    """r_i - mean of the other members = n/(n-1) * (r_i - group mean); a group of one keeps r."""
    mean, _, size = _group_stats(rewards, group_ids)
    scale = size / (size - 1).clamp_min(1)
    return torch.where(size < 2, rewards, scale * (rewards - mean))


def _token_whiten(values: Tensor, num_tokens: Tensor) -> Tensor:
    """verl `masked_whiten` of a per-token tensor in which sequence i repeats values[i] over its
    num_tokens[i] tokens: token-weighted mean, unbiased token-level variance."""
    weights = num_tokens.to(values.dtype)
    total = weights.sum()
    if total < 2:
        return values - values.mean() if values.numel() else values
    mean = (weights * values).sum() / total
    var = (weights * (values - mean) ** 2).sum() / total * (total / (total - 1))
    return (values - mean) * torch.rsqrt(var + WHITEN_EPS)


def reinforce_plus_plus_advantages(
    rewards: Tensor, group_ids: Tensor, num_tokens: Tensor, cfg: AlgoConfig
) -> Tensor:
    """REINFORCE++ with an outcome reward and gamma 1: every token's return is r; whiten globally."""
    return _token_whiten(rewards, num_tokens)


def reinforce_plus_plus_baseline_advantages(
    rewards: Tensor, group_ids: Tensor, num_tokens: Tensor, cfg: AlgoConfig
) -> Tensor:
    """REINFORCE++-baseline: subtract the group mean (a group of one: 0), then whiten globally."""
    mean, _, size = _group_stats(rewards, group_ids)
    mean = torch.where(size < 2, torch.zeros_like(mean), mean)
    return _token_whiten(rewards - mean, num_tokens)


AdvantageFn = Callable[[Tensor, Tensor, Tensor, AlgoConfig], Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
}

# ---------------------------------------------------------------- aggregation


@dataclass
class Segments:
    """Which sequence each token belongs to, and the global denominators of the optimizer step.

    The denominators cover the whole optimizer step (every micro-batch), so summing micro-batch
    losses gives the full-batch loss and gradients do not depend on the micro-batch split.
    """

    loss_mask: Tensor  # [B, T] float, 1 where the logprob at t (of token t+1) is trained
    seq_index: Tensor  # [B, T] long, index into seq_num_tokens (any value where loss_mask is 0)
    seq_num_tokens: Tensor  # [S] float, loss tokens of each sequence of this micro-batch
    num_tokens: float  # loss tokens in the whole optimizer step
    num_seqs: float  # sequences (with >= 1 loss token) in the whole optimizer step

    def seq_sum(self, values: Tensor) -> Tensor:
        """[B, T] -> [S]: masked sum of values over each sequence."""
        out = torch.zeros(self.seq_num_tokens.shape[0], dtype=values.dtype, device=values.device)
        return out.index_add(0, self.seq_index.reshape(-1), (values * self.loss_mask).reshape(-1))

    def token_mean(self, values: Tensor) -> Tensor:
        """Masked sum over the global token count: the micro-batch share of a global token mean."""
        return (values * self.loss_mask).sum() / max(self.num_tokens, 1.0)


def seq_mean_token_mean(values: Tensor, seg: Segments) -> Tensor:
    """mean over sequences (global count) of each sequence's token mean."""
    per_seq = seg.seq_sum(values) / seg.seq_num_tokens.clamp_min(1)
    return per_seq.sum() / max(seg.num_seqs, 1.0)


def seq_mean_token_sum(values: Tensor, seg: Segments) -> Tensor:
    """mean over sequences (global count) of each sequence's token sum."""
    return seg.seq_sum(values).sum() / max(seg.num_seqs, 1.0)


AggregateFn = Callable[[Tensor, Segments], Tensor]
AGGREGATORS: dict[str, AggregateFn] = {
    "token_mean": lambda values, seg: seg.token_mean(values),
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
}

# ---------------------------------------------------------------- policy losses
# Every policy loss: (log_probs, old_log_probs, advantages [B, T], seg, clip) ->
# (per-token loss [B, T], per-token 0/1 stats [B, T]). Stats are token-averaged by the caller.


@dataclass(frozen=True)
class ClipRange:
    low: float  # ratio floor is 1 - low
    high: float  # ratio ceiling is 1 + high (clip-higher when > low)
    dual_c: float | None = None  # dual-clip bound on -A * ratio for A < 0 (> 1), None = off


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip: ClipRange
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO: max(-A r, -A clip(r)), then dual clip min(., -c A) for A < 0."""
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - clip.low, 1 + clip.high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    stats = _clip_stats((loss_clipped > loss_unclipped).float(), ratio)  # slime/verl pg_clipfrac
    if clip.dual_c is not None:
        dual_bound = -clip.dual_c * advantages
        stats["dual_clip_frac"] = ((loss > dual_bound) & (advantages < 0)).float()
        loss = torch.where(advantages < 0, torch.minimum(loss, dual_bound), loss)
    return loss, stats


def ppo_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, seg: Segments, clip: ClipRange
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level clipped ratio pi/pi_old (PPO, DAPO clip-higher, dual clip)."""
    log_ratio = (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _clipped_surrogate(log_ratio.exp(), advantages, clip)


def gspo_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, seg: Segments, clip: ClipRange
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: one ratio per sequence, the geometric mean exp(mean_t log pi/pi_old), clipped with the
    same ranges (the paper uses ~3e-4 / 4e-4). Gradient flows through the sequence mean (slime)."""
    seq_log_ratio = seg.seq_sum(log_probs - old_log_probs) / seg.seq_num_tokens.clamp_min(1)  # [S]
    log_ratio = seq_log_ratio[seg.seq_index].clamp(max=10.0)  # [B, T]; verl clamps at 10
    # The dual clip bounds -A * (sequence ratio) for A < 0, as slime applies it to GSPO.
    return _clipped_surrogate(log_ratio.exp(), advantages, clip)


def cispo_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, seg: Segments, clip: ClipRange
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): -sg(clip(ratio)) * A * log pi; clipped tokens keep their gradient."""
    ratio = (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    weight = ratio.clamp(1 - clip.low, 1 + clip.high).detach()
    return -weight * advantages * log_probs, _clip_stats((weight != ratio.detach()).float(), ratio)


def _clip_stats(is_clipped: Tensor, ratio: Tensor) -> dict[str, Tensor]:
    return {
        "clip_frac": is_clipped,
        "clip_frac_high": is_clipped * (ratio > 1).float(),
        "clip_frac_low": is_clipped * (ratio < 1).float(),
    }


PolicyLossFn = Callable[
    [Tensor, Tensor, Tensor, Segments, ClipRange], tuple[Tensor, dict[str, Tensor]]
]
POLICY_LOSSES: dict[str, PolicyLossFn] = {"ppo": ppo_loss, "gspo": gspo_loss, "cispo": cispo_loss}

# ---------------------------------------------------------------- KL to the reference
# Schulman's estimators of KL(pi || pi_ref) on samples from pi; all [B, T] -> [B, T].


def kl_k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return log_probs - ref_log_probs


def kl_k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return 0.5 * (log_probs - ref_log_probs) ** 2


def kl_k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """exp(ref - logp) - (ref - logp) - 1, non-negative; clamped like verl's low_var_kl."""
    log_ratio = (ref_log_probs - log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_k3,
}

# ---------------------------------------------------------------- truncated importance sampling


def tis_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """min(pi_trainer_old / pi_rollout, cap), no gradient: token-level rollout correction
    (`rollout_correction.token_log_ratio`), kept for its callers."""
    raw = (
        (old_log_probs - rollout_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().detach()
    )
    weights = raw.clamp(max=cap)
    return weights, {"tis_weight_mean": weights, "tis_clip_frac": (weights != raw).float()}


# ---------------------------------------------------------------- the objective


@dataclass
class LossInputs:
    """Everything the objective reads for one micro-batch, besides the new log_probs."""

    seg: Segments
    advantages: Tensor  # [B, T]
    old_log_probs: Tensor  # [B, T] trainer logprobs before this rollout's updates
    rollout_log_probs: Tensor  # [B, T] engine logprobs at sampling time
    ref_log_probs: Tensor | None = None  # [B, T]


# How a metric combines over micro-batches: summed shares of a global mean, or max/min.
MAX_METRICS = ("ratio_max", "tis_weight_max")
MIN_METRICS = ("ratio_min",)


@dataclass
class PolicyObjective:
    """pg loss (+ kl_loss_coef * KL) - entropy_coef * entropy, aggregated with global denominators."""

    policy_loss: PolicyLossFn
    aggregate: AggregateFn
    clip: ClipRange
    kl: Callable[[Tensor, Tensor], Tensor] | None
    kl_loss_coef: float
    entropy_coef: float
    correction: RolloutCorrection | None
    """Rollout correction (IS weights, rejection); None = metrics only."""

    def __call__(
        self, log_probs: Tensor, entropy: Tensor | None, x: LossInputs
    ) -> tuple[Tensor, dict[str, Tensor]]:
        seg = x.seg
        pg_losses, stats = self.policy_loss(
            log_probs, x.old_log_probs, x.advantages, seg, self.clip
        )
        stats["logprob_abs_diff"] = (x.old_log_probs - x.rollout_log_probs).abs()
        mismatch, seq_stats = mismatch_stats(x.old_log_probs, x.rollout_log_probs, seg)
        stats.update(mismatch)
        metrics: dict[str, Tensor] = {}
        # A rejected token leaves every loss term but stays in the step's denominators, as a
        # clipped PPO token does (NeMo-RL's icepop; verl and slime shrink the mask instead).
        keep: Tensor | float = 1.0
        if self.correction is not None:
            out = self.correction(x.old_log_probs, x.rollout_log_probs, seg)
            pg_losses, keep = pg_losses * out.weights * out.keep, out.keep
            stats.update(out.token_stats)
            seq_stats.update(out.seq_stats)
            metrics.update(out.max_stats)
        pg_loss = self.aggregate(pg_losses, seg)
        loss = pg_loss
        metrics["pg_loss"] = pg_loss.detach()
        if self.kl is not None and x.ref_log_probs is not None:
            kl_loss = self.aggregate(self.kl(log_probs, x.ref_log_probs) * keep, seg)
            loss = loss + self.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        if entropy is not None and self.entropy_coef:
            loss = loss - self.entropy_coef * self.aggregate(entropy * keep, seg)
        metrics["loss"] = loss.detach()
        with torch.no_grad():
            log_ratio = (log_probs - x.old_log_probs).detach()
            ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
            stats.update(approx_kl=-log_ratio, ratio_mean=ratio)  # approx_kl: slime/verl ppo_kl
            if entropy is not None:
                stats["entropy"] = entropy.detach()
            metrics.update(_trained_token_sums(stats, seg))
            metrics.update(_packed_sequence_sums(seq_stats, seg))
            metrics.update(_ratio_extremes(ratio, seg))
        return loss, metrics


# Diagnostics (ratio, clip fractions, entropy, approx_kl, TIS, mismatch) are means over the tokens
# the step trained. A sequence left out of the micro-batches (advantage 0 without a KL or entropy
# term) counts in the loss's denominators but has no logprobs to measure: over those denominators
# an on-policy step read ratio_mean 0.593 with ratio_min = ratio_max = 1 (issue 39). No micro-batch
# knows the step's trained-token count, so each sends sums and its count; `diagnostic_means`
# divides once every micro-batch and rank is combined.
NUM_PACKED_LOSS_TOKENS = "num_packed_loss_tokens"
NUM_PACKED_SEQS = "num_packed_seqs"
_SUM_PREFIX = "sum/"
_SEQ_SUM_PREFIX = "seq_sum/"  # per-sequence stats, averaged over the packed sequences


def _trained_token_sums(stats: Mapping[str, Tensor], seg: Segments) -> dict[str, Tensor]:
    """Each per-token stat [B, T] summed over this micro-batch's loss tokens, with their count."""
    sums = {_SUM_PREFIX + name: (value * seg.loss_mask).sum() for name, value in stats.items()}
    return {**sums, NUM_PACKED_LOSS_TOKENS: seg.loss_mask.sum()}


def _packed_sequence_sums(stats: Mapping[str, Tensor], seg: Segments) -> dict[str, Tensor]:
    """Each per-sequence stat [S] summed over this micro-batch's sequences with loss tokens, with
    their count (a mean over sequences weighs a long one as much as a short one)."""
    if not stats:
        return {}
    is_packed = (seg.seq_num_tokens > 0).to(seg.loss_mask.dtype)  # [S]
    sums = {_SEQ_SUM_PREFIX + name: (value * is_packed).sum() for name, value in stats.items()}
    return {**sums, NUM_PACKED_SEQS: is_packed.sum()}


def diagnostic_means(metrics: Mapping[str, float]) -> dict[str, float]:
    """Combined metrics with every `sum/<name>` turned into `<name>`, its mean over the step's
    trained tokens (`num_packed_loss_tokens`, kept as a metric), and every `seq_sum/<name>` into
    its mean over the step's packed sequences (`num_packed_seqs`)."""
    num_tokens = max(float(metrics.get(NUM_PACKED_LOSS_TOKENS, 0.0)), 1.0)
    num_seqs = max(float(metrics.get(NUM_PACKED_SEQS, 0.0)), 1.0)
    out = {}
    for name, value in metrics.items():
        if name.startswith(_SUM_PREFIX):
            out[name.removeprefix(_SUM_PREFIX)] = value / num_tokens
        elif name.startswith(_SEQ_SUM_PREFIX):
            out[name.removeprefix(_SEQ_SUM_PREFIX)] = value / num_seqs
        else:
            out[name] = value
    return out


def _ratio_extremes(ratio: Tensor, seg: Segments) -> dict[str, Tensor]:
    """ratio_max / ratio_min over this micro-batch's trained tokens (none: no entry)."""
    is_loss = seg.loss_mask > 0
    if not bool(is_loss.any()):
        return {}
    return {"ratio_max": ratio[is_loss].max(), "ratio_min": ratio[is_loss].min()}


def build_objective(cfg: AlgoConfig) -> PolicyObjective:
    """Choose the loss, aggregation and KL functions once (`AlgoConfig`'s field types checked
    the names and ranges when it was built)."""
    agg_mode = loss_agg_mode(cfg)
    high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    use_kl = cfg.use_kl_loss and cfg.kl_loss_coef > 0
    return PolicyObjective(
        policy_loss=POLICY_LOSSES[cfg.policy_loss],
        aggregate=AGGREGATORS[agg_mode],
        clip=ClipRange(cfg.eps_clip, high, cfg.eps_clip_c),
        kl=KL_ESTIMATORS[cfg.kl_loss_type] if use_kl else None,
        kl_loss_coef=cfg.kl_loss_coef if use_kl else 0.0,
        entropy_coef=cfg.entropy_coef,
        correction=build_correction(settings_from_config(cfg)),
    )


DEFAULT_LOSS_AGG_MODE = {"gspo": "seq_mean_token_mean"}  # GSPO: arXiv 2507.18071, eq. 5


def loss_agg_mode(cfg: AlgoConfig) -> str:
    """The aggregation in force: the configured one, else the policy loss's own."""
    default = DEFAULT_LOSS_AGG_MODE.get(cfg.policy_loss, "token_mean")
    if cfg.loss_agg_mode is None:
        return default
    if cfg.loss_agg_mode != default and cfg.policy_loss in DEFAULT_LOSS_AGG_MODE:
        logger.warning(
            "algo.loss_agg_mode=%s overrides %s's own %s: longer sequences weigh more than the "
            "paper's objective",
            cfg.loss_agg_mode,
            cfg.policy_loss,
            default,
        )
    return cfg.loss_agg_mode


def combine_metrics(parts: Sequence[Mapping[str, Tensor | float]]) -> dict[str, float]:
    """Reduce per-micro-batch (or per-rank) metric shares to step values (sum, or max/min for
    extremes), in order: every rank that combines the same parts gets the same floats."""
    out: dict[str, float] = {}
    for part in parts:
        for name, value in part.items():
            v = float(value)
            if name not in out:
                out[name] = v
            elif name in MAX_METRICS:
                out[name] = max(out[name], v)
            elif name in MIN_METRICS:
                out[name] = min(out[name], v)
            else:
                out[name] += v
    return out
