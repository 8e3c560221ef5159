"""Advantage estimators, policy losses, KL, TIS and aggregation against hand-computed values."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from agentrl.config import AlgoConfig
from agentrl.trainer.losses import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ClipRange,
    LossInputs,
    Segments,
    build_objective,
    combine_metrics,
    diagnostic_means,
    tis_weights,
)


def _t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


def _one_row(num_tokens: int, *, seq_index=None, mask=None, num_seqs=None) -> Segments:
    """Segments for a single row of `num_tokens`; by default one token per sequence."""
    seq_index = torch.arange(num_tokens) if seq_index is None else torch.tensor(seq_index)
    mask = torch.ones(num_tokens) if mask is None else torch.tensor(mask, dtype=torch.float32)
    num_s = int(seq_index.max()) + 1
    counts = torch.zeros(num_s).index_add(0, seq_index, mask)
    return Segments(
        loss_mask=mask[None].double(),
        seq_index=seq_index[None],
        seq_num_tokens=counts.double(),
        num_tokens=float(mask.sum()),
        num_seqs=float(num_s if num_seqs is None else num_seqs),
    )


# ---------------------------------------------------------------- advantages


def test_grpo_normalises_by_group_std():
    rewards, groups = _t([1, 0, 0, 1, 2, 2, 5]), torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv = ADVANTAGE_ESTIMATORS["grpo"](rewards, groups, torch.ones(7), AlgoConfig())
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6)] * 2
    assert adv[:4].tolist() == pytest.approx(
        [expected[0], expected[1], expected[1], expected[0]], rel=1e-9
    )
    assert adv[4:6].tolist() == [0.0, 0.0]  # zero-variance group: no signal
    assert adv[6].item() == pytest.approx(5.0 / (1 + 1e-6))  # a group of one: mean 0, std 1 (verl)


def test_dr_grpo_only_centres():
    rewards, groups = _t([1, 0, 0, 1, 3]), torch.tensor([0, 0, 0, 0, 1])
    cfg = AlgoConfig(normalize_advantage_std=False)
    adv = ADVANTAGE_ESTIMATORS["grpo"](rewards, groups, torch.ones(5), cfg)
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5, 3.0]


def test_rloo_leaves_one_out():
    rewards, groups = _t([1, 0, 0, 1, 7]), torch.tensor([0, 0, 0, 0, 1])
    adv = ADVANTAGE_ESTIMATORS["rloo"](rewards, groups, torch.ones(5), AlgoConfig())
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 7.0])


def test_reinforce_plus_plus_whitens_over_tokens():
    # Token values [1, 0, 0, 0]: mean 0.25, unbiased var 0.25 -> std 0.5.
    adv = ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](
        _t([1, 0]), torch.tensor([0, 1]), _t([1, 3]), AlgoConfig()
    )
    assert adv.tolist() == pytest.approx([1.5, -0.5], rel=1e-6)


def test_reinforce_plus_plus_baseline_centres_groups_then_whitens():
    rewards, groups, tokens = _t([1, 0, 3]), torch.tensor([0, 0, 1]), _t([1, 1, 2])
    adv = ADVANTAGE_ESTIMATORS["reinforce_plus_plus_baseline"](
        rewards, groups, tokens, AlgoConfig()
    )
    # Centred [0.5, -0.5, 3] (singleton baseline 0); tokens [0.5, -0.5, 3, 3]: mean 1.5, var 9.5/3.
    std = math.sqrt(9.5 / 3)
    assert adv.tolist() == pytest.approx([-1 / std, -2 / std, 1.5 / std], rel=1e-6)


# ---------------------------------------------------------------- aggregation


def test_aggregators_use_global_denominators():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    seg = _one_row(4, seq_index=[0, 0, 1, 1], mask=[1, 1, 1, 0], num_seqs=4)
    seg.num_tokens = 6.0  # the whole optimizer step has 6 loss tokens and 4 sequences
    assert AGGREGATORS["token_mean"](values, seg).item() == pytest.approx(6 / 6)
    assert AGGREGATORS["seq_mean_token_mean"](values, seg).item() == pytest.approx((1.5 + 3.0) / 4)
    assert AGGREGATORS["seq_mean_token_sum"](values, seg).item() == pytest.approx((3.0 + 3.0) / 4)


# ---------------------------------------------------------------- policy losses


PPO_RATIOS = [1.5, 0.5, 1.1, 0.5, 5.0]
PPO_ADV = [1.0, -1.0, 1.0, 1.0, -1.0]


def _ppo(clip: ClipRange):
    seg = _one_row(5)
    log_probs = torch.log(_t([PPO_RATIOS])).requires_grad_(True)
    losses, stats = POLICY_LOSSES["ppo"](
        log_probs, torch.zeros(1, 5, dtype=torch.float64), _t([PPO_ADV]), seg, clip
    )
    return losses, stats, seg, log_probs


def test_ppo_clip_higher_values_and_clip_fractions():
    losses, stats, seg, _ = _ppo(ClipRange(0.2, 0.28))
    # r=1.5,A=1 clipped at 1.28; r=0.5,A=-1 clipped at 0.8; r=1.1 inside; r=0.5,A=1 keeps -0.5;
    # r=5,A=-1: max(5, 1.28) = 5 (no dual clip).
    assert losses[0].tolist() == pytest.approx([-1.28, 0.8, -1.1, -0.5, 5.0])
    assert seg.token_mean(stats["clip_frac"]).item() == pytest.approx(2 / 5)
    assert seg.token_mean(stats["clip_frac_high"]).item() == pytest.approx(1 / 5)
    assert seg.token_mean(stats["clip_frac_low"]).item() == pytest.approx(1 / 5)


def test_ppo_dual_clip_bounds_negative_advantages():
    losses, stats, seg, _ = _ppo(ClipRange(0.2, 0.28, dual_c=3.0))
    assert losses[0].tolist() == pytest.approx([-1.28, 0.8, -1.1, -0.5, 3.0])
    assert seg.token_mean(stats["dual_clip_frac"]).item() == pytest.approx(1 / 5)


def test_ppo_clipped_tokens_have_zero_gradient():
    losses, _, _, log_probs = _ppo(ClipRange(0.2, 0.28, dual_c=3.0))
    losses.sum().backward()
    # d(-A r)/d log r = -A r where unclipped; 0 where the clip or the dual clip is active.
    assert log_probs.grad[0].tolist() == pytest.approx([0.0, 0.0, -1.1, -0.5, 0.0])


def test_gspo_uses_one_geometric_mean_ratio_per_sequence():
    seg = _one_row(3, seq_index=[0, 0, 1])
    log_probs = _t([[0.1, 0.3, -0.5]]).requires_grad_(True)
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv = _t([[1.0, 1.0, -1.0]])
    losses, stats = POLICY_LOSSES["gspo"](log_probs, old, adv, seg, ClipRange(0.2, 0.28))
    r0 = math.exp(0.2)  # exp(mean(0.1, 0.3)) inside the clip range
    assert losses[0].tolist() == pytest.approx([-r0, -r0, 0.8])  # exp(-0.5) clipped up to 0.8
    loss = AGGREGATORS["seq_mean_token_mean"](losses, seg)
    assert loss.item() == pytest.approx((-r0 + 0.8) / 2)
    loss.backward()
    # d/d logp_t of -s0 (s0 = exp(mean logp)) is -s0 / 2 per token, then / 2 sequences.
    assert log_probs.grad[0].tolist() == pytest.approx([-r0 / 4, -r0 / 4, 0.0])
    assert seg.token_mean(stats["clip_frac"]).item() == pytest.approx(1 / 3)


def test_cispo_keeps_gradient_through_clipped_tokens():
    seg = _one_row(2)
    log_probs = torch.log(_t([[1.5, 1.0]])).requires_grad_(True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    losses, stats = POLICY_LOSSES["cispo"](
        log_probs, old, _t([[1.0, 2.0]]), seg, ClipRange(0.2, 0.28)
    )
    assert losses[0].tolist() == pytest.approx([-1.28 * math.log(1.5), 0.0])
    losses.sum().backward()
    assert log_probs.grad[0].tolist() == pytest.approx([-1.28, -2.0])  # -sg(clip(r)) * A
    assert seg.token_mean(stats["clip_frac_high"]).item() == pytest.approx(1 / 2)


# ---------------------------------------------------------------- KL and TIS


def test_kl_estimators():
    logp, ref = _t([-1.0]), _t([-2.0])
    assert KL_ESTIMATORS["k1"](logp, ref).item() == pytest.approx(1.0)
    assert KL_ESTIMATORS["k2"](logp, ref).item() == pytest.approx(0.5)
    assert KL_ESTIMATORS["k3"](logp, ref).item() == pytest.approx(math.exp(-1))  # e^-1 + 1 - 1
    assert KL_ESTIMATORS["low_var_kl"](_t([-30.0]), _t([0.0])).item() == 10.0  # clamped like verl


def test_tis_weights_are_capped_and_reported():
    old, rollout = torch.log(_t([[3.0, 0.5]])), torch.zeros(1, 2, dtype=torch.float64)
    weights, stats = tis_weights(old, rollout, cap=2.0)
    assert weights[0].tolist() == pytest.approx([2.0, 0.5])
    assert stats["tis_clip_frac"][0].tolist() == [1.0, 0.0]


def test_objective_reports_mismatch_tis_and_kl_metrics():
    cfg = AlgoConfig(
        use_tis=True, tis_cap=2.0, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1"
    )
    objective = build_objective(cfg)
    seg = _one_row(2)
    old = torch.log(_t([[3.0, 0.5]]))
    log_probs = old.clone().requires_grad_(True)  # on-policy: ratio 1
    x = LossInputs(seg, _t([[1.0, 1.0]]), old, torch.zeros(1, 2, dtype=torch.float64), old - 1.0)
    loss, parts = objective(log_probs, None, x)
    metrics = diagnostic_means(combine_metrics([parts]))
    assert metrics["tis_clip_frac"] == pytest.approx(0.5)
    assert metrics["tis_weight_mean"] == pytest.approx((2.0 + 0.5) / 2)
    assert metrics["logprob_abs_diff"] == pytest.approx((math.log(3) + math.log(2)) / 2)
    assert metrics["kl_loss"] == pytest.approx(1.0)  # k1 = 1 on both tokens
    # pg: -(2 + 0.5) / 2 ; kl: 0.5 * 1
    assert loss.item() == pytest.approx(-1.25 + 0.5)
    assert metrics["ratio_max"] == pytest.approx(1.0)


def test_entropy_bonus_lowers_the_loss():
    seg = _one_row(2)
    zeros = torch.zeros(1, 2, dtype=torch.float64)
    x = LossInputs(seg, zeros, zeros, zeros)
    entropy = _t([[1.0, 3.0]])
    loss, parts = build_objective(AlgoConfig(entropy_coef=0.1))(zeros.clone(), entropy, x)
    assert loss.item() == pytest.approx(-0.1 * 2.0)
    assert diagnostic_means(combine_metrics([parts]))["entropy"] == pytest.approx(2.0)


def test_diagnostics_average_over_packed_tokens_not_the_loss_denominator():
    """Issue 39: a tied group left unpacked counts in the loss's denominator (10 tokens here,
    4 of them packed), yet an on-policy step's ratio is 1 on every token it measured."""
    seg = _one_row(2)
    micro_batches = [replace(seg, num_tokens=10.0), replace(seg, num_tokens=10.0)]
    objective = build_objective(AlgoConfig())
    parts = []
    for mb_seg in micro_batches:
        old = torch.log(_t([[0.3, 0.6]]))
        x = LossInputs(mb_seg, _t([[1.0, -1.0]]), old, old)
        parts.append(objective(old.clone(), _t([[1.0, 3.0]]), x)[1])
    metrics = diagnostic_means(combine_metrics(parts))
    assert metrics["ratio_mean"] == metrics["ratio_min"] == metrics["ratio_max"] == 1.0
    assert metrics["entropy"] == 2.0 and metrics["clip_frac"] == metrics["approx_kl"] == 0.0
    assert metrics["num_packed_loss_tokens"] == 4.0
    assert "sum/ratio_mean" not in metrics


@pytest.mark.parametrize("policy_loss", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("agg", sorted(AGGREGATORS))
def test_masked_tokens_get_exactly_zero_gradient(policy_loss: str, agg: str):
    cfg = AlgoConfig(
        policy_loss=policy_loss,
        loss_agg_mode=agg,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coef=0.01,
        use_tis=True,
        eps_clip_c=3.0 if policy_loss == "ppo" else None,
    )
    objective = build_objective(cfg)
    gen = torch.Generator().manual_seed(0)
    mask = [1, 1, 0, 1, 0, 0, 1, 1]
    seg = _one_row(8, seq_index=[0, 0, 0, 1, 1, 2, 2, 2], mask=mask)
    log_probs = (-torch.rand(1, 8, generator=gen, dtype=torch.float64)).requires_grad_(True)
    entropy = torch.rand(1, 8, generator=gen, dtype=torch.float64).requires_grad_(True)

    def noise() -> torch.Tensor:
        return torch.randn(1, 8, generator=gen, dtype=torch.float64) * 0.3

    x = LossInputs(
        seg,
        noise(),
        log_probs.detach() + noise(),
        log_probs.detach() + noise(),
        log_probs.detach() + noise(),
    )
    loss, _ = objective(log_probs, entropy, x)
    loss.backward()
    off = torch.tensor(mask) == 0
    assert torch.all(log_probs.grad[0][off] == 0.0)
    assert torch.all(entropy.grad[0][off] == 0.0)
    assert torch.all(log_probs.grad[0][~off] != 0.0)


def test_an_algo_config_out_of_its_field_types_is_refused_when_built():
    """Not later by `build_objective`: the config's pydantic field types check every value."""
    with pytest.raises(ValueError, match="eps_clip_c\n  Input should be greater than 1"):
        AlgoConfig(eps_clip_c=0.5)
    with pytest.raises(ValueError, match="policy_loss\n  Input should be 'ppo', 'gspo' or 'cispo'"):
        AlgoConfig(policy_loss="grpo")  # type: ignore[arg-type]


def test_combine_metrics_sums_shares_and_keeps_extremes():
    parts = [
        {
            "loss": torch.tensor(0.25),
            "ratio_max": torch.tensor(1.5),
            "ratio_min": torch.tensor(0.9),
        },
        {"loss": torch.tensor(0.5), "ratio_max": torch.tensor(1.2), "ratio_min": torch.tensor(0.7)},
    ]
    assert combine_metrics(parts) == pytest.approx(
        {"loss": 0.75, "ratio_max": 1.5, "ratio_min": 0.7}
    )


def test_gspo_without_an_aggregation_flag_averages_per_sequence(caplog):
    """GSPO's objective (arXiv 2507.18071, eq. 5) is a mean over sequences. Two sequences of 1
    and 3 tokens, ratio 1, advantages +1 and -1: per sequence -(+1) and -(-1), mean 0; a token
    mean would weigh the long one 3x: (-1 + 3) / 4 = 0.5."""
    seg = _one_row(4, seq_index=[0, 1, 1, 1])
    zeros = torch.zeros(1, 4, dtype=torch.float64)
    adv = _t([[1.0, -1.0, -1.0, -1.0]])
    x = LossInputs(seg, adv, zeros, zeros)
    loss, _ = build_objective(AlgoConfig(policy_loss="gspo"))(zeros.clone(), None, x)
    assert loss.item() == pytest.approx(0.0)
    with caplog.at_level("WARNING"):
        overridden, _ = build_objective(AlgoConfig(policy_loss="gspo", loss_agg_mode="token_mean"))(
            zeros.clone(), None, x
        )
    assert overridden.item() == pytest.approx(0.5)
    assert "overrides gspo's own seq_mean_token_mean" in caplog.text
    ppo, _ = build_objective(AlgoConfig())(zeros.clone(), None, x)
    assert ppo.item() == pytest.approx(0.5)  # ppo keeps token_mean


def test_gspo_applies_the_dual_clip_to_the_sequence_ratio():
    """A < 0 with a sequence ratio of e^2 (far above 1 + eps): the PPO-clipped loss -A * r is
    bounded by the dual clip at -c * A = 3 (it was silently dropped for GSPO before)."""
    seg = _one_row(2, seq_index=[0, 0])
    log_probs = _t([[2.0, 2.0]])
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = _t([[-1.0, -1.0]])
    without, _ = POLICY_LOSSES["gspo"](log_probs, old, adv, seg, ClipRange(0.2, 0.2))
    with_dual, stats = POLICY_LOSSES["gspo"](log_probs, old, adv, seg, ClipRange(0.2, 0.2, 3.0))
    assert without[0].tolist() == pytest.approx([math.exp(2.0)] * 2)
    assert with_dual[0].tolist() == pytest.approx([3.0, 3.0])
    assert stats["dual_clip_frac"][0].tolist() == [1.0, 1.0]
