"""Rollout correction: presets and fields resolved once, `--use-tis` as token-level IS, rejected
tokens out of every loss term, and a planted mismatch between a tiny model and its perturbed copy
masked exactly where it should be."""

from __future__ import annotations

import pytest
import torch

from agentrl.config import AlgoConfig
from agentrl.config_correction import (
    PRESETS,
    CorrectionSettings,
    PresetName,
    settings_from_config,
)
from agentrl.trainer.losses import (
    LossInputs,
    Segments,
    build_objective,
    combine_metrics,
    diagnostic_means,
)


def _seg(mask: list[float], seq_index: list[int]) -> Segments:
    loss_mask = torch.tensor([mask], dtype=torch.float64)
    index = torch.tensor([seq_index])
    counts = torch.zeros(max(seq_index) + 1, dtype=torch.float64).index_add(
        0, index[0], loss_mask[0]
    )
    return Segments(loss_mask, index, counts, float(loss_mask.sum()), float(len(counts)))


def test_use_tis_is_token_level_is_at_tis_cap_and_a_preset_or_field_wins():
    assert settings_from_config(AlgoConfig(use_tis=True, tis_cap=3.0)) == CorrectionSettings(
        rollout_is="token", rollout_is_threshold=3.0
    )
    assert (
        settings_from_config(AlgoConfig(use_tis=True, rollout_correction="seq_tis"))
        == (PRESETS["seq_tis"])
    )
    mixed = settings_from_config(AlgoConfig(rollout_correction="icepop", rollout_rs_threshold=4.0))
    assert (mixed.rollout_rs, mixed.rollout_rs_threshold, mixed.rollout_rs_threshold_lower) == (
        "token",
        4.0,
        0.5,
    )


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_rejected_tokens_get_no_gradient_from_any_term(name: PresetName):
    """Tool tokens (mask 0) and rejected tokens get exactly zero gradient; kept ones do not."""
    cfg = AlgoConfig(rollout_correction=name, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
    mask = [1, 1, 0, 0, 1, 1, 1, 0, 1, 1]
    seg = _seg([float(m) for m in mask], [0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(1, 10, generator=gen, dtype=torch.float64)
    # Sequence 0 matches its rollout but for token 1, far off; sequence 1 matches exactly.
    rollout = old.clone()
    rollout[0, 1] -= 3.0
    log_probs = old.clone().requires_grad_(True)
    entropy = torch.rand(1, 10, generator=gen, dtype=torch.float64).requires_grad_(True)
    x = LossInputs(seg, torch.ones(1, 10, dtype=torch.float64), old, rollout, old - 0.1)
    loss, parts = build_objective(cfg)(log_probs, entropy, x)
    loss.backward()
    assert log_probs.grad is not None
    grad = log_probs.grad[0]
    assert torch.all(grad[torch.tensor(mask) == 0] == 0)
    assert torch.all(grad[5:][torch.tensor(mask[5:]) == 1] != 0)  # the clean sequence trains
    metrics = diagnostic_means(combine_metrics([parts]))
    masked = metrics.get("rs_masked_frac", 0.0)
    rejected = grad[:5][torch.tensor(mask[:5]) == 1] == 0
    # token levels drop token 1 alone, sequence levels (and the veto) all of sequence 0, IS alone
    # (token_tis, seq_tis) nothing: the step reports what it dropped.
    assert masked == pytest.approx(float(rejected.sum()) / sum(mask))
    assert metrics["mismatch_kl_k1"] == pytest.approx(-3.0 / sum(mask))
