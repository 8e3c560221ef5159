"""verl's and slime's rollout-correction functions, mirrored for the peer checks (neither installs
here). Only the parts that compute weights and masks are kept; their metric dictionaries, config
objects and context-parallel plumbing are left out. Formulas are transcribed as written.

verl: volcengine/verl @ 0b4e2a814129c07f016787cbce476132ceb6c5cb,
  verl/trainer/ppo/rollout_corr_helper.py (`compute_rollout_correction_weights`,
  `compute_rollout_rejection_mask`, the veto step of
  `compute_rollout_correction_and_rejection_mask`, `compute_offpolicy_metrics`'s kl / k3_kl);
  `masked_sum` / `masked_mean` from verl/utils/torch_functional.py (1e-8 added to the count).
  Rows are sequences, [B, T], `response_mask` 0 on padding and on tool tokens.
slime: THUDM/slime @ 141e5efce1f087137c14fc95dd0bbaee13ff5910,
  examples/train_infer_mismatch_helper/mis.py (`compute_mis_weights`, `add_ppl_metrics`'s
  kl / k3_kl): one 1-D tensor per sequence, `loss_mask` 0 on tool tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

SAFETY_BOUND = 20.0


# ---------------------------------------------------------------- verl


def verl_masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def verl_masked_mean(values, mask, axis=None):
    return verl_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def verl_is_weights(log_ratio, response_mask, rollout_is, rollout_is_threshold):
    """`compute_rollout_correction_weights` without metrics or batch normalisation."""
    if rollout_is == "token":
        weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    elif rollout_is == "sequence":
        log_ratio_sum = verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(
            torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)
        ).expand_as(log_ratio)
    else:
        raise ValueError(rollout_is)
    weights = weights * response_mask
    return weights.clamp(max=rollout_is_threshold).detach()


def verl_rejection_mask(
    log_ratio, response_mask, rollout_rs, rollout_rs_threshold, rollout_rs_threshold_lower=None
):
    """`compute_rollout_rejection_mask`: the modified response mask."""
    upper = rollout_rs_threshold
    lower = rollout_rs_threshold_lower if rollout_rs_threshold_lower is not None else 1.0 / upper
    if rollout_rs == "token":
        weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    elif rollout_rs == "sequence":
        log_ratio_sum = verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(
            torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)
        ).expand_as(log_ratio)
    elif rollout_rs == "geometric":
        log_ratio_mean = verl_masked_mean(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(
            torch.clamp(log_ratio_mean, min=-SAFETY_BOUND, max=SAFETY_BOUND)
        ).expand_as(log_ratio)
    else:
        raise ValueError(rollout_rs)
    mask = ((weights >= lower) & (weights <= upper)).float()
    return response_mask * mask


def verl_veto_mask(log_ratio, response_mask, rollout_token_veto_threshold):
    """The veto step: 0 for every token of a sequence holding a catastrophic token."""
    log_veto_threshold = torch.log(torch.tensor(rollout_token_veto_threshold))
    catastrophic_tokens = (log_ratio < log_veto_threshold) & response_mask.bool()
    has_catastrophic = catastrophic_tokens.any(dim=-1, keepdim=True)
    return (~has_catastrophic).float()


def verl_correction(old_log_prob, rollout_log_prob, response_mask, **cfg):
    """`compute_rollout_correction_and_rejection_mask`: (IS weights or None, modified mask)."""
    log_ratio = old_log_prob - rollout_log_prob
    weights = None
    if cfg.get("rollout_is") is not None:
        weights = verl_is_weights(
            log_ratio, response_mask, cfg["rollout_is"], cfg.get("rollout_is_threshold", 2.0)
        )
    mask = response_mask.clone()
    if cfg.get("rollout_rs") is not None:
        mask = verl_rejection_mask(
            log_ratio,
            response_mask,
            cfg["rollout_rs"],
            cfg["rollout_rs_threshold"],
            cfg.get("rollout_rs_threshold_lower"),
        )
    if cfg.get("rollout_token_veto_threshold") is not None:
        mask = mask * verl_veto_mask(log_ratio, response_mask, cfg["rollout_token_veto_threshold"])
    return weights, mask


def verl_offpolicy_kl(old_log_prob, rollout_log_prob, response_mask):
    """`compute_offpolicy_metrics`' kl (k1) and k3_kl: token means over the batch."""
    kl = verl_masked_mean(rollout_log_prob - old_log_prob, response_mask)
    log_ratio = old_log_prob - rollout_log_prob
    k3 = verl_masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask)
    return float(kl), float(k3)


# ---------------------------------------------------------------- slime


def _slime_masked_sum(x, loss_mask, expand=False):
    result = (x * loss_mask).sum()
    return result.expand_as(x) if expand else result


def _slime_masked_mean(x, loss_mask, expand=False):
    result = _slime_masked_sum(x, loss_mask) / torch.clamp_min(loss_mask.sum(), 1)
    return result.expand_as(x) if expand else result


def slime_args(**kw):
    """The `args` fields `compute_mis_weights` reads (slime's mis.yaml names)."""
    defaults = dict(
        mis_level="token",
        mis_mode="truncate",
        mis_upper_bound=2.0,
        mis_lower_bound=0.5,
        mis_veto_threshold=None,
    )
    return SimpleNamespace(**{**defaults, **kw})


def slime_mis_weights(args, *, train_log_probs, rollout_log_probs, loss_masks):
    """`compute_mis_weights`: per sequence (weights, modified mask); metrics left out."""
    all_weights, all_masks = [], []
    for train, rollout, loss_mask in zip(
        train_log_probs, rollout_log_probs, loss_masks, strict=True
    ):
        loss_mask = loss_mask.float()
        raw = train - rollout
        if args.mis_level == "token":
            level = raw
        elif args.mis_level == "sequence":
            level = _slime_masked_sum(raw, loss_mask, expand=True)
        elif args.mis_level == "geometric":
            level = _slime_masked_mean(raw, loss_mask, expand=True)
        else:
            raise ValueError(args.mis_level)
        weights = torch.exp(torch.clamp(level, min=-SAFETY_BOUND, max=SAFETY_BOUND))
        modified = loss_mask.clone().float()
        if args.mis_mode == "truncate":
            weights = weights.clamp(0, args.mis_upper_bound) * loss_mask
        elif args.mis_mode == "mask":
            in_range = (weights >= args.mis_lower_bound) & (weights <= args.mis_upper_bound)
            modified = loss_mask * in_range.float()
            weights = weights * loss_mask
        elif args.mis_mode == "clip":
            weights = weights.clamp(args.mis_lower_bound, args.mis_upper_bound) * loss_mask
        else:
            raise ValueError(args.mis_mode)
        if args.mis_veto_threshold is not None:
            log_veto = torch.log(torch.tensor(args.mis_veto_threshold))
            has_catastrophic = ((raw < log_veto) & loss_mask.bool()).any()
            modified = modified * (~has_catastrophic).float().expand_as(raw)
        all_weights.append(weights.detach())
        all_masks.append(modified.detach())
    return all_weights, all_masks


def slime_kl(train_log_prob, rollout_log_prob):
    """`add_ppl_metrics`' per-token kl (k1) and k3_kl."""
    log_ratio = train_log_prob - rollout_log_prob
    return rollout_log_prob - train_log_prob, torch.exp(log_ratio) - log_ratio - 1
