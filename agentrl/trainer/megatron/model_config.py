"""A Hugging Face config (Llama, Qwen2, Qwen3) read as the shape of a Megatron `GPTModel` and the
keyword arguments of its `TransformerConfig`, as plain data: nothing here imports megatron."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from agentrl.config import TrainConfig

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelShape:
    """What the weight map and the model builder need to know of one checkpoint."""

    family: str  # HF model_type: llama, qwen2 or qwen3
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    has_qkv_bias: bool  # Qwen2: q/k/v projections carry a bias
    has_qk_norm: bool  # Qwen3: RMSNorm on each head's query and key
    is_tied: bool  # lm_head shares the embedding matrix
    rope_linear_factor: float | None = None  # linear RoPE scaling (position interpolation)

    def padded_vocab_size(self, tp_size: int) -> int:
        """The vocabulary rounded up to a multiple of the TP size (Megatron splits it evenly);
        padded rows never reach a softmax (see vocab_parallel.py)."""
        return math.ceil(self.vocab_size / tp_size) * tp_size


def _rope_theta(hf_config: Any) -> float:
    theta = getattr(hf_config, "rope_theta", None)
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(theta if theta is not None else params.get("rope_theta", 10000.0))


def _rope_linear_factor(hf_config: Any) -> float | None:
    """transformers >= 5 keeps RoPE settings in rope_parameters, older ones in rope_scaling."""
    scaling = (
        getattr(hf_config, "rope_parameters", None)
        or getattr(hf_config, "rope_scaling", None)
        or {}
    )
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return float(scaling["factor"])
    raise ValueError(
        f"model rope_type={kind!r} is not supported by the Megatron backend (default and linear "
        "RoPE are); train this model with --train-backend torch"
    )


def model_shape(hf_config: Any) -> ModelShape:
    """Read and check a transformers config; unsupported features raise a ValueError that names
    them."""
    family = getattr(hf_config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model_type={family!r} is not supported by the Megatron backend (it builds "
            f"{', '.join(SUPPORTED_FAMILIES)}); train this model with --train-backend torch"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu" or getattr(hf_config, "mlp_bias", False):
        raise ValueError(
            f"{family}: hidden_act={hf_config.hidden_act!r}, mlp_bias="
            f"{getattr(hf_config, 'mlp_bias', False)}; the Megatron backend builds a bias-free "
            "SwiGLU MLP: use --train-backend torch"
        )
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    has_bias = family == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
    return ModelShape(
        family=family,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        norm_eps=hf_config.rms_norm_eps,
        rope_theta=_rope_theta(hf_config),
        max_position_embeddings=hf_config.max_position_embeddings,
        has_qkv_bias=has_bias,
        has_qk_norm=family == "qwen3",
        is_tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        rope_linear_factor=_rope_linear_factor(hf_config),
    )


def check_parallel_fit(shape: ModelShape, train_cfg: TrainConfig) -> None:
    """Megatron splits heads, query groups and the MLP over TP and layers over PP evenly."""
    tp = train_cfg.tensor_model_parallel_size
    pp = train_cfg.pipeline_model_parallel_size
    for what, count in (
        ("num_attention_heads", shape.num_heads),
        ("num_key_value_heads", shape.num_kv_heads),
        ("intermediate_size", shape.ffn_hidden_size),
    ):
        if count % tp:
            raise ValueError(
                f"--tensor-model-parallel-size {tp} does not divide the model's {what}={count}; "
                "choose a TP size that divides it"
            )
    if shape.num_layers % pp:
        raise ValueError(
            f"--pipeline-model-parallel-size {pp} does not divide the model's "
            f"num_hidden_layers={shape.num_layers}; choose a PP size that divides it"
        )


def recompute_kwargs(granularity: str | None) -> dict[str, Any]:
    """slime's --recompute-granularity: full = whole layers (uniform, one layer per checkpoint);
    selective = core attention only."""
    if granularity == "full":
        return dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    return {} if granularity is None else dict(recompute_granularity=granularity)


def transformer_config_kwargs(
    shape: ModelShape, train_cfg: TrainConfig, *, params_dtype: Any
) -> dict[str, Any]:
    """Arguments of megatron.core's TransformerConfig for this model and these parallel sizes,
    but the SwiGLU activation and the two fusions model.py turns on where it can. The other
    fusions need TransformerEngine or apex kernels: off, so the local layer spec runs without
    them."""
    return dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        layernorm_epsilon=shape.norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        add_qkv_bias=shape.has_qkv_bias,
        qk_layernorm=shape.has_qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=train_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=train_cfg.pipeline_model_parallel_size,
        sequence_parallel=train_cfg.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        variable_seq_lengths=True,  # packed micro-batches differ in length
        moe_token_dispatcher_type="alltoall",  # dense models; the default refuses variable lengths
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        **recompute_kwargs(train_cfg.recompute_granularity),
    )


def gpt_model_kwargs(shape: ModelShape, tp_size: int) -> dict[str, Any]:
    """Arguments of GPTModel besides config, layer spec and pipeline position."""
    kwargs: dict[str, Any] = dict(
        vocab_size=shape.padded_vocab_size(tp_size),
        max_sequence_length=shape.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=shape.rope_theta,
        share_embeddings_and_output_weights=shape.is_tied,
    )
    if shape.rope_linear_factor is not None:
        kwargs["seq_len_interpolation_factor"] = shape.rope_linear_factor
    return kwargs
