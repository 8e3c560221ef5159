"""TorchBackend on a tiny random Llama: packing, micro-batch invariance, learning, save/load, export."""

from __future__ import annotations

import math
import re

import pytest
import torch

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainer.backend import TrainerBackend, make_trainer_backend
from agentrl.trainer.batch import TrainBatch, build_train_batches, sampling_masks
from agentrl.trainer.torch_backend import TorchBackend
from agentrl.types import Turn


def _backend(path: str, algo: AlgoConfig | None = None, **train_kw) -> TorchBackend:
    backend = TorchBackend(path, TrainConfig(**train_kw), algo or AlgoConfig(), device="cpu")
    backend.setup()
    return backend


def _per_sample_logprobs(batch: TrainBatch) -> dict[int, torch.Tensor]:
    out = {}
    for mb in batch.micro_batches():
        for r in range(mb.input_ids.shape[0]):
            for local, index in enumerate(mb.sample_indices):
                sel = (mb.seq_index[r] == local) & (mb.loss_mask[r] > 0)
                if sel.any():
                    out[index] = mb.old_logprobs[r][sel]
    return out


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_rows_give_the_same_logprobs_as_sequences_alone(tiny_llama_path, groups_factory):
    groups = groups_factory(num_groups=3, group_size=4, seed=0)
    backend = _backend(tiny_llama_path)
    packed = backend.compute_logprobs(
        build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=40, pad_id=0)[0]
    )
    # A budget of one token: every sequence alone in its micro-batch, nothing packed beside it.
    alone = backend.compute_logprobs(
        build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=1, pad_id=0)[0]
    )
    assert all(len(mb.sample_indices) == 1 for mb in alone.micro_batches())
    assert any(len(mb.sample_indices) > 1 for mb in packed.micro_batches())
    a, b = _per_sample_logprobs(packed), _per_sample_logprobs(alone)
    assert sorted(a) == sorted(b) == list(range(12))
    for i in a:
        assert torch.allclose(a[i], b[i], atol=1e-5), i


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo",
    [
        AlgoConfig(loss_agg_mode="token_mean", use_tis=True),
        AlgoConfig(loss_agg_mode="seq_mean_token_mean", entropy_coef=0.01),
        AlgoConfig(loss_agg_mode="seq_mean_token_sum", policy_loss="cispo"),
        AlgoConfig(loss_agg_mode="seq_mean_token_mean", policy_loss="gspo", use_tis=True),
    ],
    ids=["token_mean+tis", "seq_mean_token_mean+entropy", "seq_mean_token_sum+cispo", "gspo+tis"],
)
def test_loss_and_gradients_do_not_depend_on_the_micro_batch_split(
    tiny_llama_path, groups_factory, algo
):
    groups = groups_factory(num_groups=2, group_size=4, seed=5)
    backend = _backend(tiny_llama_path, algo, lr=0.0, clip_grad=0.0)  # lr 0: weights stay put
    results = []
    for budget in (10_000, 12, 1):
        batch = build_train_batches(groups, algo, max_tokens_per_micro_batch=budget, pad_id=0)[0]
        metrics = backend.train_step(batch)
        results.append(
            (batch.metrics["batch/num_micro_batches"], metrics["loss"], _grads(backend.model))
        )
    (n_one, loss_one, grads_one), *others = results
    assert n_one == 1
    for n_many, loss_many, grads_many in others:
        assert n_many > 3
        assert loss_many == pytest.approx(loss_one, rel=1e-5, abs=1e-7)
        for name, g in grads_one.items():
            assert torch.allclose(grads_many[name], g, rtol=1e-4, atol=1e-7), name


def test_gradient_checkpointing_gives_the_same_gradients(tiny_llama_path, groups_factory):
    groups = groups_factory(num_groups=2, group_size=4, seed=8)
    grads = []
    for use_checkpointing in (False, True):
        backend = _backend(
            tiny_llama_path, lr=0.0, clip_grad=0.0, gradient_checkpointing=use_checkpointing
        )
        batch = build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=30, pad_id=0)[
            0
        ]
        backend.train_step(batch)
        model = backend.model
        name = "is_activation_checkpointing"  # transformers >= 5; before: is_gradient_checkpointing
        is_on = getattr(model, name) if hasattr(model, name) else model.is_gradient_checkpointing
        assert is_on == use_checkpointing
        grads.append(_grads(backend.model))
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, atol=1e-6), name


def test_train_step_lowers_the_loss_on_a_repeated_batch(tiny_llama_path, groups_factory):
    groups = groups_factory(num_groups=2, group_size=4, seed=1)
    backend = _backend(tiny_llama_path, lr=1e-2)
    batch = build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=0)[0]
    backend.compute_logprobs(batch)  # fix the old policy, so the surrogate can move
    losses = [backend.train_step(batch)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.05
    assert backend.optimizer_step == 4 and backend.num_train_steps == 4


def test_global_batch_size_takes_several_optimizer_steps_from_one_old_policy(
    tiny_llama_path, groups_factory
):
    groups = groups_factory(num_groups=3, group_size=4, seed=2)
    backend = _backend(tiny_llama_path, lr=1e-2)
    batch = build_train_batches(
        groups, AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=0, global_batch_size=5
    )[0]
    metrics = backend.train_step(batch)
    assert metrics["num_optimizer_steps"] == 3.0 and backend.optimizer_step == 3
    assert all(mb.old_logprobs is not None for mb in batch.micro_batches())
    assert metrics["approx_kl"] != 0.0  # later steps see a policy that already moved
    assert metrics["grad_norm"] > 0.0 and metrics["lr"] == pytest.approx(1e-2)
    assert metrics["num_trained_sequences"] == 12.0 and metrics["num_excluded_error"] == 0.0
    assert backend.pad_id == 0  # the tiny config's pad_token_id


def test_reference_model_only_with_a_positive_kl_coefficient(tiny_llama_path, groups_factory):
    off = _backend(tiny_llama_path, AlgoConfig(use_kl_loss=True, kl_loss_coef=0.0))
    off.model  # noqa: B018 - loads lazily
    assert off.ref_model is None
    algo = AlgoConfig(use_kl_loss=True, kl_loss_coef=0.1)
    on = _backend(tiny_llama_path, algo, lr=1e-2)
    batch = build_train_batches(
        groups_factory(2, 4, seed=3), algo, max_tokens_per_micro_batch=64, pad_id=0
    )[0]
    first = on.train_step(batch)
    assert on.ref_model is not None
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-6)  # same weights as the reference
    batch = build_train_batches(
        groups_factory(2, 4, seed=4), algo, max_tokens_per_micro_batch=64, pad_id=0
    )[0]
    assert on.train_step(batch)["kl_loss"] > 0.0


def test_save_load_round_trip_restores_weights_optimizer_and_counters(
    tiny_llama_path, groups_factory, tmp_path
):
    from transformers import AutoModelForCausalLM

    groups = groups_factory(num_groups=2, group_size=4, seed=6)

    def batch() -> TrainBatch:
        return build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=0)[0]

    kw = dict(lr=1e-2, lr_warmup_steps=2, lr_decay_style="cosine", num_rollout=5, weight_decay=0.1)
    a = _backend(tiny_llama_path, **kw)
    a.train_step(batch())
    a.train_step(batch())
    a.save(tmp_path / "ckpt")
    b = _backend(tiny_llama_path, **kw)
    b.load(tmp_path / "ckpt")
    assert b.optimizer_step == 2 and b.num_train_steps == 2
    for (name, pa), pb in zip(
        a.model.state_dict().items(), b.model.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])
    assert a.scheduler.get_last_lr() == b.scheduler.get_last_lr()
    # transformers loads the directory as a model.
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"))
    assert torch.equal(hf.model.embed_tokens.weight, a.model.model.embed_tokens.weight)
    # The next step is identical on both.
    ma, mb = a.train_step(batch()), b.train_step(batch())
    assert ma["loss"] == mb["loss"] and ma["lr"] == mb["lr"]
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    # The schedule goes on decaying from where it was (steps 3 and 4 of 5, after 2 of warmup).
    lrs = [(a.train_step(batch())["lr"], b.train_step(batch())["lr"]) for _ in range(2)]
    assert [la for la, _ in lrs] == [lb for _, lb in lrs]
    assert lrs[0][0] == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi / 3)))


def test_load_names_a_directory_without_weights(tiny_llama_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        _backend(tiny_llama_path).load(tmp_path)


def test_export_weights_buckets_hf_names_without_tied_duplicates(tiny_llama_path):
    backend = _backend(tiny_llama_path)
    engine_state = dict(backend._hf_tensors(None))
    assert "lm_head.weight" not in engine_state  # tied to model.embed_tokens.weight
    assert "model.embed_tokens.weight" in engine_state
    buckets = list(backend.export_weights(bucket_size_bytes=8 * 1024))
    assert len(buckets) > 1
    for bucket in buckets[:-1]:
        assert sum(t.numel() * t.element_size() for _, t in bucket) <= 8 * 1024 or len(bucket) == 1
    flat = [name for bucket in buckets for name, _ in bucket]
    assert flat == list(engine_state)
    (_, first), *_ = next(iter(backend.export_weights(dtype=torch.bfloat16)))
    assert first.dtype == torch.bfloat16


def test_torch_backend_is_a_trainer_backend(tiny_llama_path):
    backend = TorchBackend(tiny_llama_path, TrainConfig(), AlgoConfig(), device="cpu")
    assert isinstance(backend, TrainerBackend)
    assert backend.pad_id == 0 and backend._model is None  # pad_id never loads (or shards) it


def test_setup_loads_once_and_nothing_runs_before_it(tiny_llama_path, groups_factory):
    """An explicit `setup()` (collective under FSDP) instead of a load on first use: a method
    called before it names the fix; the factory returns a backend already set up."""
    backend = TorchBackend(tiny_llama_path, TrainConfig(), AlgoConfig(), device="cpu")
    batch = build_train_batches(groups_factory(num_groups=1, group_size=2), AlgoConfig(),
                              max_tokens_per_micro_batch=64, pad_id=0)[0]  # fmt: skip
    for call in (lambda: backend.train_step(batch), backend.pending_state_bytes,
                 lambda: backend.compute_logprobs(batch)):  # fmt: skip
        with pytest.raises(RuntimeError, match=r"TorchBackend.setup\(\) has not run: call it once"):
            call()
    backend.setup()
    model = backend.model
    backend.setup()  # a second call keeps the model (and the optimizer state) it has
    assert backend.model is model and backend.pending_state_bytes() > 0
    built = make_trainer_backend(tiny_llama_path, TrainConfig(), AlgoConfig(), device="cpu",
                                 dtype="auto", temperature=1.0)  # fmt: skip
    assert built._model is not None  # type: ignore[attr-defined]


def test_sequence_logprobs_are_the_tempered_log_softmax_of_the_logits(tiny_llama_path):
    backend = TorchBackend(
        tiny_llama_path, TrainConfig(), AlgoConfig(), device="cpu", temperature=0.7
    )
    backend.setup()
    ids = [5, 9, 17, 33, 8, 41, 12]
    got = backend.sequence_logprobs(ids, 2)
    with torch.no_grad():
        logits = backend.model(torch.tensor([ids])).logits[0].float()  # [L, V]
    want = torch.log_softmax(logits / 0.7, dim=-1)[torch.arange(1, 6), torch.tensor(ids[2:])]
    assert len(got) == len(ids) - 2
    assert got == pytest.approx(want.tolist(), abs=1e-5)
    assert backend.sequence_logprobs(ids, len(ids)) == []
    with pytest.raises(ValueError, match="start=0 must be in \\[1, 7\\]"):
        backend.sequence_logprobs(ids, 0)


def test_sequence_logprobs_replay_a_turns_top_k(tiny_llama_path):
    """The lag probe scores a top-k turn under the distribution it was sampled from, as training
    does: the top-3 renormalised, not the whole softmax (whose gap would be the mass cut)."""
    backend = TorchBackend(
        tiny_llama_path, TrainConfig(), AlgoConfig(), device="cpu", temperature=0.7
    )
    backend.setup()
    ids = [5, 9, 17, 33, 8, 41, 12]
    turn = Turn(start=3, num_sampled=4, num_observation=0, weight_version=0,
                finish_reason="stop", top_k=3, is_logprob_truncated=True)  # fmt: skip
    masks = sampling_masks([turn], len(ids) - 1)
    got = backend.sequence_logprobs(ids, 3, masks)
    with torch.no_grad():
        logits = backend.model(torch.tensor([ids])).logits[0, 2:6].float() / 0.7  # [4, V]
    top = logits.topk(3, dim=-1).values  # [4, 3]
    targets = logits.gather(1, torch.tensor(ids[3:])[:, None])[:, 0]
    kept = targets >= top[:, -1]  # a target outside the top 3 keeps its own logit (replay)
    norm = torch.logsumexp(
        torch.cat([top, torch.where(kept, -torch.inf, targets)[:, None]], -1), -1
    )
    assert got == pytest.approx((targets - norm).tolist(), abs=1e-5)
    assert got != pytest.approx(backend.sequence_logprobs(ids, 3), abs=1e-3)


def test_load_tells_a_model_directory_from_a_checkpoint(tiny_llama_path):
    with pytest.raises(FileNotFoundError, match="is a model, not a trainer checkpoint"):
        _backend(tiny_llama_path).load(tiny_llama_path)


def test_constructor_checks_config_without_loading(tiny_llama_path):
    with pytest.raises(ValueError, match="dtype='float16' is not supported"):
        TorchBackend(tiny_llama_path, TrainConfig(), AlgoConfig(), dtype="float16")
    backend = TorchBackend("/does/not/exist", TrainConfig(), AlgoConfig())
    assert backend._model is None


@pytest.mark.parametrize("backend_name", ["torch", "megatron"])
@pytest.mark.parametrize(
    ("train_kwargs", "kwargs", "message"),
    [
        ({}, {"dtype": "float16"}, "dtype='float16' is not supported; use auto"),
        ({}, {"temperature": 0.0}, "temperature=0.0 must be > 0"),
        ({}, {"device": "tpu"}, "model.device='tpu' is not a torch device; use auto, cpu"),
    ],
)
def test_every_backend_refuses_bad_arguments_before_the_machine_check(
    backend_name, train_kwargs, kwargs, message
):
    """The same one-line refusal from both backends, before Megatron's CUDA check (so a CPU
    machine hears about the bad value, not about the missing GPU)."""
    if backend_name == "megatron":
        pytest.importorskip("megatron.core")
    train_cfg = TrainConfig(backend=backend_name, **train_kwargs)
    args = {"device": "cpu", "dtype": "auto", "temperature": 1.0, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        make_trainer_backend("/does/not/exist", train_cfg, AlgoConfig(), **args)


@pytest.mark.gpu
def test_cuda_bf16_autocast_matches_cpu_and_learns(tiny_llama_path, groups_factory):
    groups = groups_factory(num_groups=2, group_size=4, seed=7)

    def batch() -> TrainBatch:
        return build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=0)[0]

    cpu = _per_sample_logprobs(_backend(tiny_llama_path).compute_logprobs(batch()))
    gpu = TorchBackend(tiny_llama_path, TrainConfig(lr=1e-2), AlgoConfig(), device="cuda")
    gpu.setup()
    fixed = gpu.compute_logprobs(batch())
    on_gpu = _per_sample_logprobs(fixed)
    for i in cpu:
        assert torch.allclose(on_gpu[i], cpu[i], atol=5e-2), i  # bf16 forward, fp32 logprobs
    losses = [gpu.train_step(fixed)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in gpu.model.parameters())  # fp32 master weights


def test_free_step_memory_hands_back_the_gradients(tiny_llama_path, groups_factory):
    """What a colocated rank calls after each step: the engine's KV cache resumes into it."""
    backend = _backend(tiny_llama_path, lr=1e-3)
    batch = build_train_batches(groups_factory(num_groups=1, group_size=4, seed=2), AlgoConfig(),
                              max_tokens_per_micro_batch=64, pad_id=0)[0]  # fmt: skip
    backend.train_step(batch)
    assert any(p.grad is not None for p in backend.model.parameters())
    backend.free_step_memory()
    assert all(p.grad is None for p in backend.model.parameters())
    assert backend.train_step(batch)["grad_norm"] > 0  # the next step rebuilds them


def test_pending_state_bytes_are_what_the_first_step_allocates(tiny_llama_path, groups_factory):
    """What a colocated engine leaves out of its KV cache: AdamW's moments, exactly."""
    backend = _backend(tiny_llama_path, lr=1e-3)
    pending = backend.pending_state_bytes()
    assert pending > 0
    batch = build_train_batches(groups_factory(num_groups=1, group_size=4, seed=3), AlgoConfig(),
                              max_tokens_per_micro_batch=64, pad_id=0)[0]  # fmt: skip
    backend.train_step(batch)
    assert backend.optimizer is not None
    moments = sum(
        t.numel() * t.element_size()
        for state in backend.optimizer.state.values()
        for name, t in state.items()
        if name != "step"
    )
    assert moments == pending and backend.pending_state_bytes() == 0


def _state_tensors(optimizer) -> list[torch.Tensor]:
    return [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def test_offload_state_on_cpu_moves_nothing(tiny_llama_path, groups_factory):
    backend = _backend(tiny_llama_path, lr=1e-3)
    batch = build_train_batches(groups_factory(num_groups=1, group_size=4, seed=4), AlgoConfig(),
                              max_tokens_per_micro_batch=64, pad_id=0)[0]  # fmt: skip
    backend.train_step(batch)
    assert backend.optimizer is not None
    before = [t.data_ptr() for t in _state_tensors(backend.optimizer)]
    backend.offload_state()
    assert not backend.is_state_offloaded
    assert [t.data_ptr() for t in _state_tensors(backend.optimizer)] == before


@pytest.mark.gpu
def test_cuda_offloaded_state_frees_its_memory_and_changes_no_step(
    tiny_llama_path, groups_factory, tmp_path
):
    """--offload-train: Adam's moments wait in pinned host memory between steps. The steps equal
    those that keep them on the GPU (to the GPU's run-to-run noise: a lost or reset moment would
    change the update by orders more), a checkpoint saved from the host reloads them, and the
    device memory they held is given back."""
    groups = groups_factory(num_groups=2, group_size=4, seed=8)

    def batch() -> TrainBatch:
        return build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=0)[0]

    def backend() -> TorchBackend:
        b = TorchBackend(tiny_llama_path, TrainConfig(lr=1e-2), AlgoConfig(), device="cuda")
        b.setup()
        return b

    kept, offloaded = backend(), backend()
    for step in range(3):
        loss = kept.train_step(batch())["loss"]
        assert offloaded.train_step(batch())["loss"] == pytest.approx(loss, rel=1e-5), step
        assert offloaded.optimizer is not None
        moments = sum(t.numel() * t.element_size() for t in _state_tensors(offloaded.optimizer))
        allocated = torch.cuda.memory_allocated()
        offloaded.offload_state()
        assert offloaded.is_state_offloaded
        assert all(
            t.device.type == "cpu" and t.is_pinned() for t in _state_tensors(offloaded.optimizer)
        )
        assert allocated - torch.cuda.memory_allocated() >= moments
    for a, b in zip(kept.model.parameters(), offloaded.model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    offloaded.save(tmp_path / "ckpt")  # from the host
    fresh = backend()
    fresh.load(tmp_path / "ckpt")
    assert fresh.optimizer is not None and not fresh.is_state_offloaded
    for a, b in zip(
        _state_tensors(offloaded.optimizer), _state_tensors(fresh.optimizer), strict=True
    ):
        assert b.device.type == "cuda" and torch.equal(a, b.cpu())
    loss = offloaded.train_step(batch())["loss"]
    assert fresh.train_step(batch())["loss"] == pytest.approx(loss, rel=1e-6)
