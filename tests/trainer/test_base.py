"""The shared train-step driver of `TrainerBackend`: what its metrics count."""

from __future__ import annotations

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainer.batch import build_train_batches
from agentrl.trainer.torch_backend import TorchBackend


def test_a_tied_group_does_not_dilute_an_on_policy_steps_diagnostics(
    tiny_llama_path, traj, groups_factory
):
    """Issue 39: ratio_mean read 0.593 with ratio_min = ratio_max = 1 on an on-policy step, the
    tied group's unpacked tokens in its denominator. Diagnostics count the packed loss tokens."""
    tied = [traj([(4, 2), (3, 0)], reward=1.0, seed=i, group_id="tied") for i in range(4)]
    groups = groups_factory(num_groups=1, group_size=4, seed=5) + [tied]
    batch = build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=0)[0]
    assert batch.metrics["batch/num_zero_advantage_skipped"] == 4.0
    backend = TorchBackend(tiny_llama_path, TrainConfig(lr=1e-3), AlgoConfig(), device="cpu")
    backend.setup()
    metrics = backend.train_step(batch)  # one step: old logprobs are the current ones
    assert metrics["ratio_mean"] == metrics["ratio_min"] == metrics["ratio_max"] == 1.0
    assert metrics["approx_kl"] == 0.0 and metrics["clip_frac"] == 0.0
    packed = sum(float(mb.loss_mask.sum()) for mb in batch.steps[0].micro_batches)
    assert metrics["num_packed_loss_tokens"] == packed < batch.steps[0].num_loss_tokens
