"""Tiny random-init models for tests: real tokenizer, a few layers, fp32."""

from __future__ import annotations

from tests.support.random_models import save_random_llama


def make_tiny_model(
    out_dir: str,
    tokenizer_source_dir: str,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    seed: int = 0,
) -> str:
    """Save a random-init LlamaForCausalLM with the source tokenizer (vocab + chat template)."""
    num_heads = max(1, hidden_size // 16)
    shape = dict(
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
    )
    return save_random_llama(out_dir, tokenizer_source_dir, shape, dtype="float32", seed=seed)
