"""Rollout correction against verl's `rollout_corr_helper` and slime's MIS example (mirrored in
tests/support/peer_rollout_correction.py with provenance), on random float64 inputs whose
sequences are multi-turn: tool tokens (loss_mask 0) sit between sampled spans."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.config import AlgoConfig
from agentrl.config_correction import PRESETS, CorrectionSettings, PresetName
from agentrl.trainer.losses import (
    LossInputs,
    Segments,
    build_objective,
    combine_metrics,
    diagnostic_means,
)
from agentrl.trainer.rollout_correction import build_correction, mismatch_stats
from tests.support import peer_rollout_correction as peer

TOL = 1e-6


class Batch:
    """Random sequences, each [sampled, tool, sampled, tool, sampled] with random lengths, as
    peers see them (one padded row per sequence) and as agentrl packs them (two rows)."""

    def __init__(self, seed: int, num_seqs: int = 12, scale: float = 0.05) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.masks: list[torch.Tensor] = []
        for _ in range(num_seqs):
            spans = torch.randint(1, 7, (5,), generator=gen).tolist()
            mask = [float(k % 2 == 0) for k, n in enumerate(spans) for _ in range(n)]
            self.masks.append(torch.tensor(mask, dtype=torch.float64))
        self.old = [-torch.rand(len(m), generator=gen, dtype=torch.float64) * 3 for m in self.masks]
        # A few sequences drift far (a stale policy), the rest a little (kernels, precision).
        self.rollout = [
            o
            + torch.randn(len(o), generator=gen, dtype=torch.float64)
            * scale
            * (8 if i % 4 == 0 else 1)
            for i, o in enumerate(self.old)
        ]

    # peers' layout: [B, T], padding with mask 0
    def padded(self, values: list[torch.Tensor]) -> torch.Tensor:
        width = max(len(v) for v in values)
        return torch.stack([torch.nn.functional.pad(v, (0, width - len(v))) for v in values])

    # agentrl's layout: sequences packed into 2 rows
    def packed(self) -> tuple[Segments, torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
        rows: list[list[int]] = [
            list(range(0, len(self.masks), 2)),
            list(range(1, len(self.masks), 2)),
        ]
        width = max(sum(len(self.masks[i]) for i in row) for row in rows)
        mask = torch.zeros(2, width, dtype=torch.float64)
        old, rollout = torch.zeros_like(mask), torch.zeros_like(mask)
        seq_index = torch.zeros(2, width, dtype=torch.long)
        where = []  # (row, start, sequence)
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                n = len(self.masks[i])
                mask[r, at : at + n] = self.masks[i]
                old[r, at : at + n], rollout[r, at : at + n] = self.old[i], self.rollout[i]
                seq_index[r, at : at + n] = i
                where.append((r, at, i))
                at += n
        counts = torch.stack([m.sum() for m in self.masks])
        seg = Segments(mask, seq_index, counts, float(counts.sum()), float(len(self.masks)))
        return seg, old, rollout, where

    def ours(self, settings: CorrectionSettings) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Our weights and keep masks, unpacked to one tensor per sequence (0 off the mask)."""
        seg, old, rollout, where = self.packed()
        correction = build_correction(settings)
        assert correction is not None
        out = correction(old, rollout, seg)
        weights, keep = out.weights, out.keep
        spans = {i: (r, at) for r, at, i in sorted(where)}
        out_w, out_k = [], []
        for i, mask in enumerate(self.masks):
            r, at = spans[i]
            out_w.append(weights[r, at : at + len(mask)] * mask)
            out_k.append(keep[r, at : at + len(mask)] * mask)
        return out_w, out_k


def _close(ours: list[torch.Tensor], theirs: torch.Tensor | list[torch.Tensor]) -> None:
    for i, mine in enumerate(ours):
        assert torch.allclose(mine, theirs[i][: len(mine)].double(), atol=TOL, rtol=0), i


SEEDS = [0, 1, 2]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_is_weights_equal_verls(seed: int, level: str):
    b = Batch(seed)
    weights, _ = b.ours(CorrectionSettings(rollout_is=level, rollout_is_threshold=1.05))
    verl_w, _ = peer.verl_correction(
        b.padded(b.old),
        b.padded(b.rollout),
        b.padded(b.masks),
        rollout_is=level,
        rollout_is_threshold=1.05,
    )
    _close(weights, verl_w)
    assert any(bool((w == 1.05).any()) for w in weights)  # the cap was reached somewhere


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_truncated_is_weights_equal_slimes(seed: int, level: str):
    """slime's MIS has the geometric level verl's IS lacks (verl: geometric for rejection only)."""
    b = Batch(seed)
    weights, _ = b.ours(CorrectionSettings(rollout_is=level, rollout_is_threshold=1.02))
    slime_w, _ = peer.slime_mis_weights(
        peer.slime_args(mis_level=level, mis_mode="truncate", mis_upper_bound=1.02),
        train_log_probs=b.old,
        rollout_log_probs=b.rollout,
        loss_masks=b.masks,
    )
    _close(weights, slime_w)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("level", "lower", "upper"),
    [
        ("token", 0.9, 1.1),
        ("sequence", 0.7, 1.3),
        ("geometric", 0.99, 1.01),
        ("geometric", None, 1.005),
    ],
)
def test_rejection_masks_equal_verls_and_slimes(seed: int, level: str, lower, upper):
    b = Batch(seed)
    settings = CorrectionSettings(
        rollout_rs=level, rollout_rs_threshold=upper, rollout_rs_threshold_lower=lower
    )
    _, keep = b.ours(settings)
    _, verl_mask = peer.verl_correction(
        b.padded(b.old),
        b.padded(b.rollout),
        b.padded(b.masks),
        rollout_rs=level,
        rollout_rs_threshold=upper,
        rollout_rs_threshold_lower=lower,
    )
    _close(keep, verl_mask)
    _, slime_masks = peer.slime_mis_weights(
        peer.slime_args(
            mis_level=level,
            mis_mode="mask",
            mis_upper_bound=upper,
            mis_lower_bound=lower if lower is not None else 1 / upper,
        ),
        train_log_probs=b.old,
        rollout_log_probs=b.rollout,
        loss_masks=b.masks,
    )
    _close(keep, slime_masks)
    num_kept = sum(float(k.sum()) for k in keep)
    assert 0 < num_kept < sum(float(m.sum()) for m in b.masks)  # some kept, some rejected


@pytest.mark.parametrize("seed", SEEDS)
def test_token_veto_equals_verls_and_slimes(seed: int):
    b = Batch(seed, scale=0.5)
    _, keep = b.ours(CorrectionSettings(rollout_token_veto_threshold=0.3))
    _, verl_mask = peer.verl_correction(
        b.padded(b.old), b.padded(b.rollout), b.padded(b.masks), rollout_token_veto_threshold=0.3
    )
    _close(keep, verl_mask)
    _, slime_masks = peer.slime_mis_weights(
        peer.slime_args(mis_mode="truncate", mis_veto_threshold=0.3),
        train_log_probs=b.old,
        rollout_log_probs=b.rollout,
        loss_masks=b.masks,
    )
    _close(keep, slime_masks)
    vetoed = [float(k.sum()) == 0 for k in keep]
    assert any(vetoed) and not all(vetoed)


VERL_PRESETS: list[PresetName] = ["token_tis", "seq_tis", "seq_mis", "geo_rs", "geo_rs_seq_tis"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", VERL_PRESETS)
def test_presets_equal_verls_correction(seed: int, name: PresetName):
    b = Batch(seed, scale=0.0005)  # geo_rs keeps a geometric ratio within 0.1% of 1
    preset = PRESETS[name]
    weights, keep = b.ours(preset)
    verl_w, verl_mask = peer.verl_correction(
        b.padded(b.old), b.padded(b.rollout), b.padded(b.masks), **vars(preset)
    )
    _close(keep, verl_mask)
    if verl_w is not None:
        _close(weights, verl_w)


@pytest.mark.parametrize("seed", SEEDS)
def test_icepop_equals_slimes_mask_mode_with_its_band(seed: int):
    """IcePop: inside [0.5, 5] the token's ratio weighs it, outside it leaves the loss -- slime's
    MIS in mask mode at token level with those bounds."""
    b = Batch(seed, scale=0.6)
    weights, keep = b.ours(PRESETS["icepop"])
    slime_w, slime_masks = peer.slime_mis_weights(
        peer.slime_args(
            mis_level="token", mis_mode="mask", mis_lower_bound=0.5, mis_upper_bound=5.0
        ),
        train_log_probs=b.old,
        rollout_log_probs=b.rollout,
        loss_masks=b.masks,
    )
    _close(keep, slime_masks)
    _close(
        [w * k for w, k in zip(weights, keep, strict=True)],
        [w * m for w, m in zip(slime_w, slime_masks, strict=True)],
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_mismatch_kl_equals_verls_token_means_and_slimes_sequence_means(seed: int):
    """Token level: verl's batch token means of kl and k3_kl. Geometric level: slime's default
    reduction of its per-token kl (each sequence's token mean, then the mean over sequences)."""
    b = Batch(seed, scale=0.3)
    seg, old, rollout, _ = b.packed()
    per_token, per_seq = mismatch_stats(old, rollout, seg)
    k1 = float((per_token["mismatch_kl_k1"] * seg.loss_mask).sum() / seg.loss_mask.sum())
    k3 = float((per_token["mismatch_kl_k3"] * seg.loss_mask).sum() / seg.loss_mask.sum())
    verl_k1, verl_k3 = peer.verl_offpolicy_kl(
        b.padded(b.old), b.padded(b.rollout), b.padded(b.masks)
    )
    assert k1 == pytest.approx(verl_k1, abs=TOL) and k3 == pytest.approx(verl_k3, abs=TOL)
    slime = [peer.slime_kl(o, r) for o, r in zip(b.old, b.rollout, strict=True)]
    for name, index in (("mismatch_geo_kl_k1", 0), ("mismatch_geo_kl_k3", 1)):
        theirs = sum(
            float((s[index] * m).sum() / m.sum()) for s, m in zip(slime, b.masks, strict=True)
        )
        assert float(per_seq[name].mean()) == pytest.approx(theirs / len(b.masks), abs=TOL)


def test_a_rejected_token_stays_in_the_denominator_where_verl_and_slime_drop_it():
    """Convention: a rejected token contributes 0 to the loss but still counts in the step's token
    denominator, as a clipped PPO token does and as NeMo-RL's icepop zeroes weights. verl and slime
    shrink the loss mask, so their token mean divides by the kept tokens only. Ours keeps the
    global denominators every micro-batch already agreed on (they are fixed before the trainer's
    logprobs exist) and lets the masked fraction be read off `rs_masked_frac`."""
    seg = Segments(
        torch.ones(1, 4, dtype=torch.float64),
        torch.zeros(1, 4, dtype=torch.long),
        torch.tensor([4.0], dtype=torch.float64),
        4.0,
        1.0,
    )
    old = torch.zeros(1, 4, dtype=torch.float64)
    rollout = torch.tensor([[0.0, 0.0, 0.0, 2.0]], dtype=torch.float64)  # token 3: ratio e^-2
    objective = build_objective(AlgoConfig(rollout_rs="token", rollout_rs_threshold=2.0))
    advantages = torch.ones(1, 4, dtype=torch.float64)
    loss, parts = objective(old.clone(), None, LossInputs(seg, advantages, old, rollout))
    assert loss.item() == pytest.approx(-3 / 4)  # verl/slime: -3 / 3
    metrics = diagnostic_means(combine_metrics([parts]))
    assert metrics["rs_masked_frac"] == pytest.approx(1 / 4)
    assert metrics["rs_seq_masked_frac"] == pytest.approx(1.0)
    assert metrics["mismatch_kl_k1"] == pytest.approx(2 / 4)
    assert metrics["mismatch_kl_k3"] == pytest.approx((math.exp(-2) + 2 - 1) / 4)
