"""Random-init Llama checkpoints with SmolLM2's tokenizer, for tests and speed work (benchmarks
and profiles): the numbers there depend on a model's shape, not on trained weights. Import from
the repo root (`pythonpath = ["."]`): `from tests.support.random_models import make_shaped_model`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentrl.model_store import resolve_model_path

# Real SmolLM2 shapes (they share one tokenizer), for random-init speed work.
SHAPES: dict[str, dict[str, int]] = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, intermediate_size=1536),
    "smollm2-360m": dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15,
                         num_key_value_heads=5, intermediate_size=2560),
    "smollm2-1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, intermediate_size=8192),
}  # fmt: skip


def make_shaped_model(
    out_dir: str,
    tokenizer_source_dir: str,
    shape: str,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    seed: int = 0,
) -> str:
    """Save a random-init Llama of a real SmolLM2 shape with the source tokenizer (speed work:
    the numbers depend on the shape, not on trained weights)."""
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} is not one of {sorted(SHAPES)}")
    return save_random_llama(
        out_dir, tokenizer_source_dir, SHAPES[shape], dtype=dtype, device=device, seed=seed
    )


def save_random_llama(
    out_dir: str,
    tokenizer_source_dir: str,
    shape: dict[str, Any],  # LlamaConfig keyword arguments
    *,
    dtype: str,
    device: str = "cpu",
    seed: int = 0,
) -> str:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(tokenizer_source_dir))
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=8192, tie_word_embeddings=True,
        **special, **shape,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(**special)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
