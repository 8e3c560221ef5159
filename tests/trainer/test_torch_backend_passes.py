"""TorchBackend wastes no passes: no old-logprob forward for a one-step batch, no reference model
without KL, no forward or backward for a batch without signal."""

from __future__ import annotations

import pytest
import torch

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainer.batch import build_train_batches
from agentrl.trainer.torch_backend import TorchBackend
from agentrl.types import EpisodeStatus


def _backend(path: str, algo: AlgoConfig | None = None, **train_kw) -> TorchBackend:
    backend = TorchBackend(path, TrainConfig(**train_kw), algo or AlgoConfig(), device="cpu")
    backend.setup()
    return backend


def _count_forwards(backend: TorchBackend) -> list[int]:
    """A counter of decoder forward passes (the policy's and the reference model's)."""
    calls = [0]

    def hook(*_):
        calls[0] += 1

    for model in (backend.model, backend.ref_model):
        if model is not None:
            model.base_model.register_forward_hook(hook)
    return calls


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_one_step_batch_takes_no_old_logprob_forward(tiny_llama_path, groups_factory):
    groups = groups_factory(num_groups=3, group_size=4, seed=2)
    for global_batch_size, passes_per_micro_batch in [(None, 1), (5, 2)]:
        backend = _backend(tiny_llama_path, lr=1e-3)
        calls = _count_forwards(backend)
        batch = build_train_batches(
            groups,
            AlgoConfig(),
            max_tokens_per_micro_batch=40,
            pad_id=0,
            global_batch_size=global_batch_size,
        )[0]
        num_micro = batch.metrics["batch/num_micro_batches"]
        assert num_micro > 1
        backend.train_step(batch)
        # One step: the loss pass alone. Several: an old-logprob pass first, then the loss pass.
        assert calls[0] == passes_per_micro_batch * num_micro, global_batch_size


@pytest.mark.parametrize(
    "algo",
    [AlgoConfig(), AlgoConfig(use_tis=True, entropy_coef=0.01, eps_clip_high=0.28)],
    ids=["grpo", "tis+entropy"],
)
def test_one_step_loss_and_gradients_equal_the_old_logprob_pass(
    tiny_llama_path, groups_factory, algo
):
    groups = groups_factory(num_groups=2, group_size=4, seed=6)
    results = []
    for is_old_pass in (False, True):
        backend = _backend(tiny_llama_path, algo, lr=0.0, clip_grad=0.0)
        batch = build_train_batches(groups, algo, max_tokens_per_micro_batch=40, pad_id=0)[0]
        if is_old_pass:
            backend.compute_logprobs(batch)  # what every step did before: a separate forward
        results.append((backend.train_step(batch), _grads(backend.model)))
    (fused, fused_grads), (separate, separate_grads) = results
    for name in ("loss", "pg_loss", "entropy", "ratio_mean", "approx_kl", "logprob_abs_diff"):
        assert abs(fused[name] - separate[name]) <= 1e-6, name
    assert fused["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert fused_grads.keys() == separate_grads.keys() and fused_grads
    for name, g in fused_grads.items():
        assert (g - separate_grads[name]).abs().max() <= 1e-6, name


def test_reference_model_is_not_loaded_without_kl(tiny_llama_path):
    for algo in (AlgoConfig(), AlgoConfig(use_kl_loss=True, kl_loss_coef=0.0)):
        backend = _backend(tiny_llama_path, algo)
        num_params = sum(p.numel() for p in backend.model.parameters())
        assert backend.ref_model is None and backend._ref_policy is None
        assert not backend.has_ref_model
        assert num_params > 0
    on = _backend(tiny_llama_path, AlgoConfig(use_kl_loss=True, kl_loss_coef=0.1))
    assert on.ref_model is not None and on.ref_model is not on.model
    assert not any(p.requires_grad for p in on.ref_model.parameters())


def _flat_groups(traj, num_groups: int = 2, group_size: int = 4) -> list:
    """Every group's rewards equal: GRPO advantages all 0."""
    return [
        [
            traj([(4, 2), (3, 0)], reward=float(g % 2), seed=10 * g + i, group_id=f"g{g}")
            for i in range(group_size)
        ]
        for g in range(num_groups)
    ]


def test_zero_variance_batch_costs_no_forward_nor_backward(tiny_llama_path, traj):
    groups = _flat_groups(traj)
    backend = _backend(tiny_llama_path, lr=1e-2)
    calls = _count_forwards(backend)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    batch = build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=40, pad_id=0)[0]
    assert batch.max_abs_advantage == 0.0 and batch.metrics["batch/num_trained_sequences"] == 8
    metrics = backend.train_step(batch)
    assert calls[0] == 0
    assert metrics["skipped_no_signal"] == 1.0 and metrics["loss"] == metrics["pg_loss"] == 0.0
    assert "grad_norm" not in metrics and "ratio_mean" not in metrics  # nothing was computed
    assert metrics["num_trained_sequences"] == 8.0 and metrics["lr"] == pytest.approx(1e-2)
    assert all(p.grad is None for p in backend.model.parameters())
    for name, p in backend.model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert backend.optimizer_step == 1 and backend.num_train_steps == 1


def test_batch_with_no_trainable_sequence_is_skipped(tiny_llama_path, traj):
    groups = [[traj([(3, 0)], status=EpisodeStatus.ERROR, seed=i) for i in range(4)]]
    backend = _backend(tiny_llama_path)
    calls = _count_forwards(backend)
    batch = build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=40, pad_id=0)[0]
    assert batch.steps == []
    metrics = backend.train_step(batch)
    assert calls[0] == 0 and metrics["skipped_no_signal"] == 1.0
    assert metrics["num_excluded_error"] == 4.0 and backend.optimizer_step == 0


@pytest.mark.parametrize(
    "algo",
    [AlgoConfig(use_kl_loss=True, kl_loss_coef=0.1), AlgoConfig(entropy_coef=0.01)],
    ids=["kl", "entropy"],
)
def test_zero_advantages_still_train_a_kl_or_entropy_term(tiny_llama_path, traj, algo):
    backend = _backend(tiny_llama_path, algo)
    calls = _count_forwards(backend)
    batch = build_train_batches(_flat_groups(traj), algo, max_tokens_per_micro_batch=400, pad_id=0)[
        0
    ]
    metrics = backend.train_step(batch)
    assert metrics["skipped_no_signal"] == 0.0 and "loss" in metrics and calls[0] > 0


def test_a_batch_with_signal_says_it_was_not_skipped(tiny_llama_path, groups_factory):
    batch = build_train_batches(
        groups_factory(2, 4, seed=1), AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=0
    )[0]
    assert batch.max_abs_advantage > 0
    assert _backend(tiny_llama_path).train_step(batch)["skipped_no_signal"] == 0.0


def test_zero_variance_groups_are_not_packed_and_the_update_is_unchanged(
    tiny_llama_path, traj, groups_factory
):
    """A tied group's sequences (advantage 0) cost no forward/backward, yet stay in the
    denominators: the gradients equal those of packing them (forced here by a negligible
    entropy term, which makes every sequence count)."""
    groups = groups_factory(num_groups=2, group_size=4, seed=3) + _flat_groups(traj)
    algo, packs_all = AlgoConfig(), AlgoConfig(entropy_coef=1e-30)
    batch = build_train_batches(groups, algo, max_tokens_per_micro_batch=400, pad_id=0)[0]
    full = build_train_batches(groups, packs_all, max_tokens_per_micro_batch=400, pad_id=0)[0]
    assert batch.metrics["batch/num_zero_advantage_skipped"] == 8.0
    assert full.metrics["batch/num_zero_advantage_skipped"] == 0.0
    lengths = [mb.num_tokens for mb in full.steps[0].micro_batches]  # one packed row each
    assert full.metrics["batch/num_packed_tokens"] == sum(lengths)
    assert 0 < batch.metrics["batch/num_packed_tokens"] < full.metrics["batch/num_packed_tokens"]
    (step,), (full_step,) = batch.steps, full.steps
    assert sum(len(mb.sample_indices) for mb in step.micro_batches) == 8
    assert (step.num_loss_tokens, step.num_seqs) == (full_step.num_loss_tokens, 16)
    grads = []
    for algo_cfg, b in ((algo, batch), (packs_all, full)):
        backend = _backend(tiny_llama_path, algo_cfg, lr=0.0, clip_grad=0.0)
        metrics = backend.train_step(b)
        assert metrics["skipped_no_signal"] == 0.0
        grads.append(_grads(backend.model))
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        assert (g - grads[1][name]).abs().max() <= 1e-6, name
