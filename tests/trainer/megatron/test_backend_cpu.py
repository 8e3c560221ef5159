"""MegatronBackend end to end on the CPU (megatron-core's own GPTModel, schedule, DDP and
optimizer; gloo; see `megatron_on_cpu`): packed logprobs equal transformers' for each family, a
train step equals the torch backend's, the export is the HF checkpoint, a checkpoint reloads.
The packed THD path (cu_seqlens, rotary embeddings per sequence) is where megatron-core versions
have changed, so this runs whatever version is installed (0.16 on Python 3.11, 0.19 on 3.12)."""

from __future__ import annotations

import pytest
import torch

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainer.batch import build_train_batches

pytestmark = pytest.mark.usefixtures("megatron_on_cpu")


def _trajectory(prompt_len: int, answer_len: int, vocab: int, reward: float, g):
    from agentrl.types import EpisodeStatus, StatusReason, Trajectory

    ids = torch.randint(3, vocab, (prompt_len + answer_len,), generator=g).tolist()
    return Trajectory(token_ids=ids, loss_mask=[0] * prompt_len + [1] * answer_len,
                      logprobs=[-1.0] * answer_len, prompt_len=prompt_len, reward=reward,
                      status=EpisodeStatus.COMPLETED, status_reason=StatusReason.DONE)  # fmt: skip


def _groups(vocab: int, seed: int = 0):
    """Two GRPO groups of 4 of mixed lengths; one 70-token trajectory, longer than the 64-token
    micro-batch budget the tests use, sits alone in its micro-batch (a single-sequence pack)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [(5, 9), (12, 20), (3, 4), (20, 50), (8, 6), (15, 11), (6, 25), (10, 3)]
    trajs = [_trajectory(p, a, vocab, float(k % 2), g) for k, (p, a) in enumerate(lengths)]
    return [trajs[:4], trajs[4:]]


def _hf_logprobs(model, trajectory) -> torch.Tensor:
    ids = torch.tensor([trajectory.token_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return logprobs.gather(-1, ids[0, 1:, None])[trajectory.prompt_len - 1 :, 0]


def _megatron(path, dtype: str = "float32", **train):
    from agentrl.trainer.megatron.backend import MegatronBackend

    train_cfg = TrainConfig(backend="megatron", **train)
    backend = MegatronBackend(str(path), train_cfg, AlgoConfig(), device="cpu", dtype=dtype)
    backend.setup()
    return backend


def _batch(groups, pad_id: int):
    return build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=pad_id)[
        0
    ]


def test_packed_logprobs_equal_transformers(hf_config, tmp_path):
    from conftest import logprobs_by_sequence, save_random_model

    model = save_random_model(hf_config, tmp_path)
    backend = _megatron(tmp_path)
    groups = _groups(hf_config.vocab_size)
    batch = backend.compute_logprobs(_batch(groups, backend.pad_id))
    assert any(len(mb.sample_indices) > 1 for mb in batch.micro_batches())  # THD packs
    assert any(len(mb.sample_indices) == 1 for mb in batch.micro_batches())
    ours = logprobs_by_sequence(batch)
    trajs = [t for g in groups for t in g]
    diff = torch.cat([(ours[i] - _hf_logprobs(model, t)).abs() for i, t in enumerate(trajs)])
    assert diff.mean().item() <= 1e-5, diff.mean().item()
    config = backend.tf_config  # the CPU runs megatron's eager SwiGLU and weight gradients
    assert not config.bias_activation_fusion and not config.gradient_accumulation_fusion
    from agentrl.trainer.megatron import rope

    assert rope._last is None  # the RoPE angles of the last micro-batch are not kept


def test_train_step_equals_the_torch_backend(configs, tmp_path):
    """Same batch, same Adam: the loss, the gradient norm and every updated weight agree."""
    from conftest import save_random_model

    from agentrl.trainer.torch_backend import TorchBackend

    save_random_model(configs["llama"](), tmp_path)
    train = dict(lr=1e-3, clip_grad=1.0)
    megatron = _megatron(tmp_path, **train)
    reference = TorchBackend(
        str(tmp_path), TrainConfig(**train), AlgoConfig(), device="cpu", dtype="float32"
    )
    reference.setup()
    groups = _groups(100)
    ours, theirs = (b.train_step(_batch(groups, megatron.pad_id)) for b in (megatron, reference))
    assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    exported = dict(kv for bucket in megatron.export_weights() for kv in bucket)
    expected = dict(kv for bucket in reference.export_weights() for kv in bucket)
    assert sorted(exported) == sorted(expected)
    worst = max((exported[k] - expected[k]).abs().max().item() for k in expected)
    moved = max((expected[k] - v).abs().max().item() for k, v in _hf_state(tmp_path).items())
    assert moved > 1e-4 and worst <= 1e-5, (moved, worst)


def _hf_state(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize(("family", "dtype"), [("qwen3", "float32"), ("llama", "bfloat16")])
def test_checkpoint_reload_reproduces_logprobs(configs, tmp_path, family, dtype):
    """In bf16 too: every parameter is in the model's dtype (the local spec's norms included,
    which megatron-core builds in float32), so the optimizer state maps onto the model's."""
    from conftest import save_random_model

    from agentrl.trainer.megatron.optimizers import torch_optimizers

    save_random_model(configs[family](), tmp_path / "hf")
    backend = _megatron(tmp_path / "hf", dtype, lr=1e-3)
    want = getattr(torch, dtype)
    assert {p.dtype for p in backend.model.parameters()} == {want}
    groups = _groups(96)
    pending = backend.pending_state_bytes()  # estimated before the optimizer exists
    backend.train_step(_batch(groups, backend.pad_id))
    (inner,) = torch_optimizers(backend.optimizer)
    moments = sum(t.numel() * t.element_size() for state in inner.state.values()
                  for name, t in state.items() if name != "step")  # fmt: skip
    masters = sum(p.numel() * p.element_size() for g in inner.param_groups for p in g["params"])
    created = moments + (masters if dtype == "bfloat16" else 0)  # fp32 master copies of bf16
    assert pending == created and backend.pending_state_bytes() == 0
    backend.save(tmp_path / "ckpt")
    after = backend.compute_logprobs(_batch(groups, backend.pad_id))
    fresh = _megatron(tmp_path / "hf", dtype, lr=1e-3)
    fresh.load(tmp_path / "ckpt")
    reloaded = fresh.compute_logprobs(_batch(groups, fresh.pad_id))
    for a, b in zip(after.micro_batches(), reloaded.micro_batches(), strict=True):
        torch.testing.assert_close(a.old_logprobs, b.old_logprobs, rtol=0, atol=1e-6)
    # The next step from the checkpoint (Adam's moments and step count reloaded into the fused
    # form megatron-core's torch fallback is switched to) equals the next step of the original.
    for b in (backend, fresh):
        b.train_step(_batch(_groups(96, seed=1), b.pad_id))
        (inner,) = torch_optimizers(b.optimizer)
        assert all(group["fused"] for group in inner.param_groups)
    ours, theirs = (dict(kv for k in b.export_weights() for kv in k) for b in (backend, fresh))
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_a_batch_without_signal_changes_nothing(configs, tmp_path):
    """Equal rewards in every group: no forward, no update (Adam's momentum would move the
    weights), the step counted, as the torch backend does."""
    from conftest import save_random_model

    save_random_model(configs["llama"](), tmp_path)
    backend = _megatron(tmp_path, lr=1e-3)
    groups = _groups(100)
    backend.train_step(_batch(groups, backend.pad_id))
    before = dict(kv for bucket in backend.export_weights() for kv in bucket)
    for group in groups:
        for t in group:
            t.reward = 1.0
    metrics = backend.train_step(_batch(groups, backend.pad_id))
    after = dict(kv for bucket in backend.export_weights() for kv in bucket)
    assert metrics["skipped_no_signal"] == 1.0 and metrics["loss"] == 0.0
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert backend.optimizer_step == 2


def test_a_step_without_packed_sequences_moves_the_schedule(configs, tmp_path):
    """Two optimizer steps of one group each, the second's rewards tied (advantage 0, nothing
    packed): the first updates, the second only counts, as in the torch backend, so the lr
    schedule keeps its horizon (before the shared step driver, Megatron did not count it)."""
    from conftest import save_random_model

    save_random_model(configs["llama"](), tmp_path)
    backend = _megatron(tmp_path, lr=1e-3, lr_warmup_steps=4, lr_decay_style="linear")
    groups = _groups(100)
    for t in groups[1]:
        t.reward = 1.0
    batch = build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=64,
                              pad_id=backend.pad_id, global_batch_size=4)[0]  # fmt: skip
    assert [bool(step.micro_batches) for step in batch.steps] == [True, False]
    metrics = backend.train_step(batch)
    assert metrics["skipped_no_signal"] == 0.0 and metrics["lr"] == pytest.approx(1e-3 / 4)
    assert backend.optimizer_step == 2
    assert backend.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 / 4)


@pytest.mark.slow
def test_agentrl_train_with_the_megatron_backend(tiny_model_path, tmp_path):
    """`train()` with train.backend=megatron (in one process): two steps whose first loss equals
    the torch backend's on the same episodes, checkpoints with Megatron's state, and a resume
    from step 1 that reproduces step 2."""
    import json

    from agentrl.run import train
    from tests.test_loop import _config

    def run(backend: str, save, resume=None):
        cfg = _config(tiny_model_path, save)
        cfg.train.backend, cfg.model.device, cfg.model.dtype = backend, "cpu", "float32"
        cfg.algo.entropy_coef = 0.01  # a random model's rewards tie: this term makes steps train
        cfg.checkpoint.resume = str(resume) if resume else None
        train(cfg)
        lines = (save / "metrics.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        return {r["step"]: r for r in rows if "train/loss" in r}

    ours, theirs = run("megatron", tmp_path / "mg"), run("torch", tmp_path / "torch")
    assert sorted(ours) == [1, 2]
    assert ours[1]["train/loss"] == pytest.approx(theirs[1]["train/loss"], abs=1e-5)
    assert (tmp_path / "mg" / "checkpoints" / "step_000002" / "megatron").is_dir()
    import shutil

    step1 = tmp_path / "mg" / "checkpoints" / "step_000001"
    shutil.copytree(step1, tmp_path / "resumed" / "checkpoints" / "step_000001")
    resumed = run("megatron", tmp_path / "resumed", resume=tmp_path / "resumed")
    assert resumed[2]["train/loss"] == pytest.approx(ours[2]["train/loss"], rel=1e-5, abs=1e-7)
