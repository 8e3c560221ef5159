"""Real configs of the three families the Megatron backend builds, and tiny random models of them."""

from __future__ import annotations

import pytest
import torch

from tests.support.random_models import SHAPES


def smollm2_config(shape: str = "smollm2-135m", **overrides):
    """SmolLM2's real config (a Llama): its shape, vocabulary and tied embeddings."""
    from transformers import LlamaConfig

    kwargs = dict(vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
                  rms_norm_eps=1e-5, rope_theta=100000.0, **SHAPES[shape])  # fmt: skip
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def qwen2_config(**overrides):
    """Qwen2.5-0.5B's layout (q/k/v bias, GQA 14:2, tied), shrunk."""
    from transformers import Qwen2Config

    kwargs = dict(vocab_size=96, hidden_size=56, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=128, rms_norm_eps=1e-6)  # fmt: skip
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def qwen3_config(**overrides):
    """Qwen3-0.6B's layout (q/k norm, head_dim larger than hidden / heads, GQA 16:8), shrunk."""
    from transformers import Qwen3Config

    kwargs = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=False, max_position_embeddings=128)  # fmt: skip
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def tiny_llama_config(**overrides):
    """SmolLM2's layout (tied, GQA 3:1 as in the 135M) at a CPU-test size."""
    kwargs = dict(num_hidden_layers=2, hidden_size=48, intermediate_size=64,
                  num_attention_heads=6, num_key_value_heads=2, vocab_size=100)  # fmt: skip
    kwargs.update(overrides)
    return smollm2_config(**kwargs)


FAMILY_CONFIGS = {"llama": tiny_llama_config, "qwen2": qwen2_config, "qwen3": qwen3_config}


def random_model(hf_config, seed: int = 0):
    """A random-init transformers causal LM of this config, fp32, with non-trivial norms."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


@pytest.fixture(params=sorted(FAMILY_CONFIGS))
def hf_config(request: pytest.FixtureRequest):
    """A tiny config of each family: llama (SmolLM2's layout), qwen2, qwen3."""
    return FAMILY_CONFIGS[request.param]()


@pytest.fixture
def configs():
    """Config builders by name, for tests that need a particular one."""
    return {**FAMILY_CONFIGS, "smollm2": smollm2_config}


@pytest.fixture
def make_random_model():
    return random_model


class _CudaOnCpu(torch.overrides.TorchFunctionMode):
    """Tensors megatron-core asks for on "cuda" (its schedules, DDP buffers and optimizer name
    the device outright) are made on the CPU, and `.type()` reports the CUDA type its asserts
    expect. With gloo for the process groups, the whole backend then runs on a CPU machine."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return args[0]
        if name == "to" and len(args) > 1 and _is_device(args[1]):
            args = (args[0], _on_cpu(args[1]), *args[2:])
        out = func(*args, **kwargs)
        if name == "type" and len(args) == 1 and not kwargs and isinstance(out, str):
            return out.replace("torch.", "torch.cuda.", 1)
        return out


def _is_device(value) -> bool:
    return isinstance(value, (str, torch.device)) or type(value) is int


def _on_cpu(device):
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if (isinstance(device, str) and device.startswith("cuda")) or type(device) is int:
        return "cpu"
    return device


class _NoStream:
    def __init__(self, *_, **__) -> None:
        pass

    def wait_event(self, *_) -> None:
        pass

    def wait_stream(self, *_) -> None:
        pass


def cuda_on_cpu_functions() -> dict:
    """The torch.cuda functions megatron-core calls, as CPU stand-ins (by name)."""
    import contextlib

    return dict(current_device=lambda: "cpu", current_stream=lambda *_, **__: _NoStream(),
                Stream=_NoStream, stream=lambda *_, **__: contextlib.nullcontext(),
                synchronize=lambda *_, **__: None, empty_cache=lambda: None)  # fmt: skip


@pytest.fixture
def megatron_on_cpu(monkeypatch):
    """megatron-core's real model, schedule, DDP and optimizer on the CPU (gloo, 1 rank): the
    backend believes it has a GPU, megatron-core's "cuda" tensors land on the CPU. Megatron's
    process groups outlive the test, as they outlive a backend in a trainer process."""
    pytest.importorskip("megatron.core")
    import asyncio

    from agentrl.trainer.megatron import requirements

    monkeypatch.setattr(requirements, "_cuda_available", lambda: True)
    for name, value in cuda_on_cpu_functions().items():
        monkeypatch.setattr(torch.cuda, name, value)
    to_thread = asyncio.to_thread

    async def to_thread_on_cpu(func, /, *args, **kwargs):  # a torch function mode is per thread
        def run():
            with _CudaOnCpu():
                return func(*args, **kwargs)

        return await to_thread(run)

    monkeypatch.setattr(asyncio, "to_thread", to_thread_on_cpu)
    with _CudaOnCpu():
        yield


def save_random_model(hf_config, directory, seed: int = 0):
    """`random_model` saved as an HF checkpoint in `directory`; returns the model."""
    model = random_model(hf_config, seed)
    model.save_pretrained(str(directory))
    return model


def logprobs_by_sequence(batch) -> list[torch.Tensor]:
    """Each trained sequence's `old_logprobs` over its loss tokens, in batch order (by
    `MicroBatch.sample_indices`): packing puts the longest sequences first, so a flat read of
    the micro-batches is not in trajectory order."""
    out = {}
    for mb in batch.micro_batches():
        for j, index in enumerate(mb.sample_indices):
            out[index] = mb.old_logprobs[(mb.seq_index == j) & (mb.loss_mask > 0)]
    return [out[i] for i in range(len(out))]
