"""HF configs read as Megatron shapes and TransformerConfig arguments; unsupported ones refused."""

from __future__ import annotations

import pytest
import torch

from agentrl.config import TrainConfig
from agentrl.trainer.megatron.model_config import (
    check_parallel_fit,
    gpt_model_kwargs,
    model_shape,
    transformer_config_kwargs,
)


def test_smollm2_135m_shape(configs):
    shape = model_shape(configs["smollm2"]("smollm2-135m"))
    assert (shape.family, shape.num_layers, shape.hidden_size) == ("llama", 30, 576)
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim) == (9, 3, 64)
    assert shape.is_tied and not shape.has_qkv_bias and not shape.has_qk_norm
    assert shape.rope_theta == 100000.0


def test_qwen_families(configs):
    qwen2, qwen3 = model_shape(configs["qwen2"]()), model_shape(configs["qwen3"]())
    assert qwen2.has_qkv_bias and not qwen2.has_qk_norm
    assert qwen3.has_qk_norm and not qwen3.has_qkv_bias
    assert qwen3.head_dim == 16 != qwen3.hidden_size // qwen3.num_heads


def test_transformer_config_follows_the_flags(configs):
    shape = model_shape(configs["qwen2"]())
    cfg = TrainConfig(backend="megatron", tensor_model_parallel_size=2, sequence_parallel=True,
                      recompute_granularity="full")  # fmt: skip
    kwargs = transformer_config_kwargs(shape, cfg, params_dtype=torch.bfloat16)
    assert kwargs["num_query_groups"] == 2 and kwargs["add_qkv_bias"] is True
    assert kwargs["tensor_model_parallel_size"] == 2 and kwargs["sequence_parallel"] is True
    assert kwargs["recompute_granularity"] == "full" and kwargs["recompute_method"] == "uniform"
    assert gpt_model_kwargs(shape, 2)["share_embeddings_and_output_weights"] is True


def test_parallel_sizes_must_divide_the_model(configs):
    shape = model_shape(configs["smollm2"]("smollm2-135m"))  # 9 heads, 3 groups, 30 layers
    check_parallel_fit(
        shape, TrainConfig(tensor_model_parallel_size=3, pipeline_model_parallel_size=5)
    )
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2 does not divide .*=9"):
        check_parallel_fit(shape, TrainConfig(tensor_model_parallel_size=2))
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 4 .*num_hidden_layers=30"):
        check_parallel_fit(shape, TrainConfig(pipeline_model_parallel_size=4))


def test_unsupported_models_are_refused_with_the_way_out():
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ValueError, match="model_type='gpt2'.*--train-backend torch"):
        model_shape(GPT2Config())
    yarn = LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 2048})  # fmt: skip
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        model_shape(yarn)
    linear = LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert gpt_model_kwargs(model_shape(linear), 1)["seq_len_interpolation_factor"] == 2.0
