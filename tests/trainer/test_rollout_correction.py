"""Rollout correction: presets and fields resolved once, `--use-tis` as token-level IS, rejected
tokens out of every loss term, and a planted mismatch between a tiny model and its perturbed copy
masked exactly where it should be."""

from __future__ import annotations

import random

import pytest
import torch

from agentrl.config import AlgoConfig, TrainConfig
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
from agentrl.trainer.rollout_correction import build_correction
from agentrl.types import EpisodeStatus, StatusReason, Trajectory
from tests.trainer.conftest import VOCAB


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


# ---------------------------------------------------------------- a planted mismatch

PLANTED_ID = 7  # the token whose logit the rollout's copy of the model gets wrong
PLANTED_BIAS = 6.0  # the size of that error, in logits


def _planted_groups(path: str, bias: float) -> list[list[Trajectory]]:
    """Trajectories over the tiny model's vocabulary: [prompt, sampled, tool, sampled]. Episodes
    1 and 5 of each group sampled PLANTED_ID once; episodes 2 and 6 only read it in a tool reply
    (mask 0). Rollout logprobs come from a bf16 copy of the model with `bias` on that token's
    logit: a precision gap everywhere, a planted one on PLANTED_ID."""
    from transformers import LlamaForCausalLM

    rollout_model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    rng = random.Random(0)
    groups = []
    for g in range(2):
        group = []
        for i in range(8):
            ids = [rng.choice([t for t in range(3, VOCAB) if t != PLANTED_ID]) for _ in range(20)]
            mask = [0] * 3 + [1] * 6 + [0] * 4 + [1] * 7
            if i % 4 == 1:
                ids[3 + 6 + 4 + rng.randrange(7)] = PLANTED_ID  # in the second sampled span
            if i % 4 == 2:
                ids[3 + 6 + rng.randrange(4)] = PLANTED_ID  # in the tool reply
            with torch.no_grad():
                logits = rollout_model(torch.tensor([ids])).logits[0].float()  # [T, V]
            logits[:, PLANTED_ID] += bias
            all_lp = torch.log_softmax(logits, dim=-1)
            logprobs = [float(all_lp[t - 1, ids[t]]) for t in range(1, len(ids)) if mask[t]]
            group.append(
                Trajectory(
                    token_ids=ids,
                    loss_mask=mask,
                    logprobs=logprobs,
                    prompt_len=3,
                    reward=float(i % 3 == 0),
                    status=EpisodeStatus.COMPLETED,
                    status_reason=StatusReason.DONE,
                    group_id=f"g{g}",
                    episode_id=f"g{g}-{i}",
                )
            )
        groups.append(group)
    return groups


PLANTED_CASES = {
    # The rollout under-weights PLANTED_ID (bias < 0): the trainer finds those tokens ~e^6 times
    # likelier, every other token ~1.6% less likely.
    # A token band: exactly the sampled PLANTED_ID tokens leave the loss.
    "token": (dict(rollout_rs="token", rollout_rs_threshold=2.0), -PLANTED_BIAS, "token"),
    "icepop": (dict(rollout_correction="icepop"), -PLANTED_BIAS, "token"),
    # Sequence levels: every token of a sequence that sampled PLANTED_ID, and only those
    # sequences (a tool reply holding it changes nothing).
    "sequence": (dict(rollout_rs="sequence", rollout_rs_threshold=3.0), -PLANTED_BIAS, "sequence"),
    "geometric": (
        dict(rollout_rs="geometric", rollout_rs_threshold=1.1),
        -PLANTED_BIAS,
        "sequence",
    ),
    # The rollout over-weights it (bias > 0): its ratio falls to ~e^-6 x 7, under the veto.
    "veto": (dict(rollout_token_veto_threshold=0.05), PLANTED_BIAS, "sequence"),
}


@pytest.mark.parametrize("case", sorted(PLANTED_CASES))
def test_a_planted_mismatch_is_masked_exactly_where_it_was_planted(tiny_llama_path, case):
    from agentrl.trainer.batch import build_train_batches
    from agentrl.trainer.torch_backend import TorchBackend

    fields, bias, level = PLANTED_CASES[case]
    algo = AlgoConfig(**fields)
    groups = _planted_groups(tiny_llama_path, bias)
    batch = build_train_batches(groups, algo, max_tokens_per_micro_batch=64, pad_id=0)[0]
    backend = TorchBackend(tiny_llama_path, TrainConfig(lr=0.0), algo, device="cpu")
    backend.setup()
    backend.compute_logprobs(batch)
    correction = build_correction(settings_from_config(algo))
    assert correction is not None
    num_expected = 0.0
    for mb in batch.micro_batches():
        assert mb.old_logprobs is not None
        seg = Segments(mb.loss_mask, mb.seq_index, mb.seq_num_tokens, 1.0, 1.0)
        keep = correction(mb.old_logprobs, mb.rollout_logprobs, seg).keep
        is_loss = mb.loss_mask > 0
        is_planted = (mb.target_ids == PLANTED_ID) & is_loss  # [R, T]
        if level == "sequence":
            planted_seqs = seg.seq_sum(is_planted.float()) > 0  # [S]
            is_planted = planted_seqs[mb.seq_index] & is_loss
        assert torch.equal((keep == 0) & is_loss, is_planted), case
        num_expected += float(is_planted.sum())
    assert num_expected > 0
    metrics = backend.train_step(batch)
    assert metrics["rs_masked_frac"] == pytest.approx(
        num_expected / metrics["num_packed_loss_tokens"]
    )
