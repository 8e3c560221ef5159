"""Real configs of the three families the Megatron backend builds, and tiny random models of them."""

from __future__ import annotations

import pytest
import torch

from agentrl.engine.model_store import SHAPES


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
