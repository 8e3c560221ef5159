"""LoRA on the Megatron backend, on the CPU (megatron-core's real model, schedule, DDP and
optimizer; gloo; see `megatron_on_cpu`): only the adapter trains, the merged export and the PEFT
adapter are the model the trainer scores, the KL reference is the base, a checkpoint resumes."""

from __future__ import annotations

import pytest
import torch

from agentrl.config import AlgoConfig, ConfigError, TrainConfig
from agentrl.trainer.batch import build_train_batches

pytestmark = pytest.mark.usefixtures("megatron_on_cpu")
LORA = dict(lora_rank=4, lora_alpha=8, lr=1e-2)


def _megatron(path, algo: AlgoConfig | None = None, **train):
    from agentrl.trainer.megatron.backend import MegatronBackend

    train_cfg = TrainConfig(backend="megatron", **{**LORA, **train})
    algo = algo or AlgoConfig()
    backend = MegatronBackend(str(path), train_cfg, algo, device="cpu", dtype="float32")
    backend.setup()
    return backend


def _batch(pad_id: int, seed: int = 0, algo: AlgoConfig | None = None):
    from test_backend_cpu import _groups

    groups = _groups(100, seed)
    batches = build_train_batches(
        groups, algo or AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=pad_id
    )
    return batches[0]


def _trained(path, steps: int = 2, **train):
    """A LoRA backend after `steps` updates (the second moves A too: at the first B is 0)."""
    backend = _megatron(path, **train)
    for seed in range(steps):
        backend.train_step(_batch(backend.pad_id, seed))
    return backend


def _exported(backend) -> dict[str, torch.Tensor]:
    return dict(kv for bucket in backend.export_weights() for kv in bucket)


def _scored(backend, seed: int = 5) -> list[torch.Tensor]:
    from conftest import logprobs_by_sequence

    return logprobs_by_sequence(backend.compute_logprobs(_batch(backend.pad_id, seed)))


def _worst(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))


@pytest.fixture
def llama_dir(configs, tmp_path):
    from conftest import save_random_model

    save_random_model(configs["llama"](), tmp_path / "hf")
    return tmp_path / "hf"


def test_only_the_adapter_trains_and_the_base_stays_bit_identical(llama_dir):
    from agentrl.trainer.megatron.optimizers import torch_optimizers

    backend = _megatron(llama_dir)
    params = dict(backend.model.module.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    for seed in range(2):
        backend.train_step(_batch(backend.pad_id, seed))
    adapters = {n for n in params if "_lora." in n}
    # 2 layers x (qkv, proj, fc1, fc2) x (A, B), all-linear by default
    assert len(adapters) == 16
    assert all(torch.equal(params[n], before[n]) for n in params if n not in adapters)
    assert all(not torch.equal(params[n], before[n]) for n in adapters)
    groups = [g for o in torch_optimizers(backend.optimizer) for g in o.param_groups]
    stepped = {id(p) for g in groups for p in g["params"]}
    assert stepped == {id(params[n]) for n in adapters}
    # the merged export moved; the adapter's own tensors are not in it
    base = _exported(_megatron(llama_dir, lora_rank=0))
    merged = _exported(backend)
    assert sorted(merged) == sorted(base)
    assert max((merged[k] - base[k]).abs().max().item() for k in base) > 1e-4


def test_a_lora_step_equals_the_torch_backends_from_the_same_adapter(llama_dir):
    """The torch backend (PEFT) given Megatron's initial adapter, its shared q/k/v and gate/up A
    repeated per projection as `export_adapter` writes it: after one step on the same batch
    (A's gradient is 0 while B is), the loss, gradient norm and merged weights agree."""
    from agentrl.trainer.torch_backend import TorchBackend

    megatron = _megatron(llama_dir, lr=1e-3, clip_grad=1.0)
    train = TrainConfig(**{**LORA, "lr": 1e-3, "clip_grad": 1.0})
    reference = TorchBackend(str(llama_dir), train, AlgoConfig(), device="cpu", dtype="float32")
    reference.setup()
    initial = dict(megatron.export_adapter().named_tensors)
    with torch.no_grad():
        for name, param in reference.model.named_parameters():
            if ".lora_" in name:
                param.copy_(initial["base_model.model." + name.replace(".default", "")])
    ours, theirs = (b.train_step(_batch(megatron.pad_id)) for b in (megatron, reference))
    assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    exported, expected = _exported(megatron), _exported(reference)
    assert sorted(exported) == sorted(expected)
    worst = max((exported[k] - expected[k]).abs().max().item() for k in expected)
    base = _exported(_megatron(llama_dir, lora_rank=0))
    moved = max((expected[k] - base[k]).abs().max().item() for k in base)
    assert moved > 1e-5 and worst <= 1e-6, (moved, worst)


def test_merged_export_and_peft_adapter_score_as_the_trainer(configs, llama_dir, tmp_path):
    """After two steps: transformers on the merged export, and transformers + PEFT on the base
    with the exported adapter (saved as a PEFT directory), give the trainer's logprobs."""
    from conftest import random_model
    from peft import PeftModel
    from test_backend_cpu import _groups, _hf_logprobs

    from agentrl.trainer.lora import save_adapter

    backend = _trained(llama_dir)
    ours = _scored(backend)
    trajs = [t for g in _groups(100, 5) for t in g]

    merged = random_model(configs["llama"]())
    merged.load_state_dict(_exported(backend), strict=False)  # a tied lm_head is not exported
    assert _worst(ours, [_hf_logprobs(merged, t) for t in trajs]) <= 1e-5

    adapter = backend.export_adapter()
    assert backend.adapter_size_bytes() == adapter.num_bytes
    assert adapter.config_dict["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    (tmp_path / "peft").mkdir()
    save_adapter(tmp_path / "peft", adapter)
    peft = PeftModel.from_pretrained(random_model(configs["llama"]()), str(tmp_path / "peft"))
    assert _worst(ours, [_hf_logprobs(peft, t) for t in trajs]) <= 1e-5
    # the base alone scores differently: the adapter did something
    assert _worst(ours, [_hf_logprobs(random_model(configs["llama"]()), t) for t in trajs]) > 1e-4


def test_the_kl_reference_is_the_base_without_a_second_copy(configs, llama_dir):
    from conftest import logprobs_by_sequence, random_model
    from test_backend_cpu import _groups, _hf_logprobs

    algo = AlgoConfig(use_kl_loss=True, kl_loss_coef=0.1)
    backend = _megatron(llama_dir, algo=algo)
    assert backend.has_ref_model and backend._ref is None
    for seed in range(2):
        backend.train_step(_batch(backend.pad_id, seed, algo))
    batch = backend.compute_logprobs(_batch(backend.pad_id, 5, algo))
    refs = {}
    for mb in batch.micro_batches():
        for j, index in enumerate(mb.sample_indices):
            refs[index] = mb.ref_logprobs[(mb.seq_index == j) & (mb.loss_mask > 0)]
    base = random_model(configs["llama"]())
    trajs = [t for g in _groups(100, 5) for t in g]
    assert (
        _worst([refs[i] for i in range(len(trajs))], [_hf_logprobs(base, t) for t in trajs]) <= 1e-5
    )
    assert _worst(logprobs_by_sequence(batch), [refs[i] for i in range(len(trajs))]) > 1e-4
    assert all(b.is_enabled for b in backend._lora.values())  # switched back on


def test_a_checkpoint_holds_the_adapter_and_resumes_exactly(llama_dir, tmp_path):
    import json

    backend = _trained(llama_dir)
    backend.save(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert (tmp_path / "ckpt" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()  # the base is --model's
    fresh = _megatron(llama_dir)
    fresh.load(tmp_path / "ckpt")
    assert _worst(_scored(backend), _scored(fresh)) == 0.0
    for b in (backend, fresh):  # Adam's moments came back too: the next steps agree
        b.train_step(_batch(b.pad_id, 7))
    ours, theirs = _exported(backend), _exported(fresh)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    with pytest.raises(ConfigError, match="resume with the checkpoint's --lora-rank"):
        _megatron(llama_dir, lora_rank=8).load(tmp_path / "ckpt")


def test_a_fused_projection_named_alone_is_refused_in_one_line(llama_dir):
    with pytest.raises(ConfigError, match="names q_proj without the rest of") as caught:
        _megatron(llama_dir, lora_target_modules=["q_proj", "o_proj"])
    assert "\n" not in str(caught.value)
    backend = _megatron(llama_dir, lora_target_modules=["q_proj", "k_proj", "v_proj"])
    qkv = [f"decoder.layers.{i}.self_attention.linear_qkv" for i in range(2)]
    assert sorted(backend._lora) == qkv
