"""The HF <-> Megatron weight map on real configs of Llama (SmolLM2), Qwen2 and Qwen3: names,
shapes, round trips, and tensor-parallel shards that compute what the HF layers compute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentrl.trainer.megatron.model_config import model_shape
from agentrl.trainer.megatron.weight_map import WeightMap, layer_offset, to_global_name


def _hf_state(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "rotary" not in k}


def test_megatron_parameters_have_megatron_shapes(hf_config, make_random_model):
    shape = model_shape(hf_config)
    wmap = WeightMap(shape)
    hf = _hf_state(make_random_model(hf_config))
    mc = dict(wmap.hf_to_megatron(hf.__getitem__))
    qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    assert mc["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (
        qkv_rows,
        shape.hidden_size,
    )
    assert mc["decoder.layers.1.mlp.linear_fc1.weight"].shape == (
        2 * shape.ffn_hidden_size,
        shape.hidden_size,
    )
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mc) == shape.has_qkv_bias
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in mc) == shape.has_qk_norm
    assert ("output_layer.weight" in mc) == (not shape.is_tied)


@pytest.mark.parametrize("spec", ["local", "te"])
def test_round_trip_gives_back_every_hf_tensor(hf_config, make_random_model, spec):
    wmap = WeightMap(model_shape(hf_config), spec=spec)
    hf = _hf_state(make_random_model(hf_config))
    back = dict(wmap.megatron_to_hf(wmap.hf_to_megatron(hf.__getitem__)))
    if hf_config.tie_word_embeddings:
        hf.pop("lm_head.weight")  # save_pretrained leaves the tied head out too
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_fused_qkv_follows_megatrons_per_group_layout(configs, make_random_model):
    """Megatron views linear_qkv's output as [groups, (heads/groups + 2) * head_dim] and splits
    each group into its query heads, its key and its value (SelfAttention.get_query_key_value_
    tensors); each TP rank holds whole groups."""
    hf_config = configs["qwen2"]()  # bias and GQA 7:1
    shape = model_shape(hf_config)
    model = make_random_model(hf_config)
    attn = model.model.layers[0].self_attn
    x = torch.randn(5, shape.hidden_size)
    for tp in (1, 2):
        wmap = WeightMap(shape, tp_size=tp)
        name = "decoder.layers.0.self_attention.linear_qkv"
        hf_names = ("q_proj", "k_proj", "v_proj")
        weights = wmap.split_tp(f"{name}.weight", wmap.to_megatron(
            f"{name}.weight", [getattr(attn, n).weight for n in hf_names]))  # fmt: skip
        biases = wmap.split_tp(f"{name}.bias", wmap.to_megatron(
            f"{name}.bias", [getattr(attn, n).bias for n in hf_names]))  # fmt: skip
        groups_per_rank = shape.num_kv_heads // tp
        per_group = shape.num_heads // shape.num_kv_heads
        d = shape.head_dim
        for rank in range(tp):
            mixed = F.linear(x, weights[rank], biases[rank]).view(5, groups_per_rank, -1)
            q, k, v = mixed.split([per_group * d, d, d], dim=-1)
            first = rank * groups_per_rank
            q_rows = slice(first * per_group * d, (first + groups_per_rank) * per_group * d)
            kv_rows = slice(first * d, (first + groups_per_rank) * d)
            torch.testing.assert_close(q.reshape(5, -1), attn.q_proj(x)[:, q_rows])
            torch.testing.assert_close(k.reshape(5, -1), attn.k_proj(x)[:, kv_rows])
            torch.testing.assert_close(v.reshape(5, -1), attn.v_proj(x)[:, kv_rows])


@pytest.mark.parametrize("tp", [1, 2])
def test_tp_shards_of_the_mlp_sum_to_the_hf_mlp(hf_config, make_random_model, tp):
    """Column-parallel fused gate/up then row-parallel down: the ranks' partial outputs add up
    to the HF MLP (Megatron's all-reduce after linear_fc2)."""
    shape = model_shape(hf_config)
    wmap = WeightMap(shape, tp_size=tp)
    mlp = make_random_model(hf_config).model.layers[1].mlp
    fc1 = wmap.split_tp("decoder.layers.1.mlp.linear_fc1.weight", wmap.to_megatron(
        "decoder.layers.1.mlp.linear_fc1.weight", [mlp.gate_proj.weight, mlp.up_proj.weight]))  # fmt: skip
    fc2 = wmap.split_tp("decoder.layers.1.mlp.linear_fc2.weight", mlp.down_proj.weight)
    x = torch.randn(3, shape.hidden_size)
    total = 0
    for rank in range(tp):
        gate, up = F.linear(x, fc1[rank]).chunk(2, dim=-1)  # Megatron's glu: chunk, silu(a) * b
        total = total + F.linear(F.silu(gate) * up, fc2[rank])
    torch.testing.assert_close(total, mlp(x))


@pytest.mark.parametrize("tp", [2, 4])
def test_split_and_merge_are_inverse(hf_config, make_random_model, tp):
    shape = model_shape(hf_config)
    if shape.num_kv_heads % tp:
        pytest.skip(f"{shape.num_kv_heads} query groups do not split over {tp} ranks")
    wmap = WeightMap(shape, tp_size=tp)
    hf = _hf_state(make_random_model(hf_config))
    for name, whole in wmap.hf_to_megatron(hf.__getitem__):
        shards = wmap.split_tp(name, whole)
        assert len(shards) == tp
        if wmap.tp_dim(name) is not None:
            assert sum(s.numel() for s in shards) == whole.numel(), name
        assert torch.equal(wmap.merge_tp(name, shards), whole), name


def test_vocab_is_padded_for_tp_and_cut_on_export(configs, make_random_model):
    hf_config = configs["qwen3"](vocab_size=97)  # odd: 2 TP ranks need 98 rows
    wmap = WeightMap(model_shape(hf_config), tp_size=2)
    hf = _hf_state(make_random_model(hf_config))
    mc = dict(wmap.hf_to_megatron(hf.__getitem__))
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert mc[name].shape[0] == 98
        assert not mc[name][97:].any()
    back = dict(wmap.megatron_to_hf(iter(mc.items())))
    assert torch.equal(back["lm_head.weight"], hf["lm_head.weight"])


def test_tied_output_layer_of_the_last_stage_reads_the_embedding(configs):
    wmap = WeightMap(model_shape(configs["smollm2"]()))
    assert wmap.hf_names("output_layer.weight") == ("model.embed_tokens.weight",)
    assert "output_layer.weight" not in wmap.megatron_names()


def test_unknown_parameter_is_named():
    wmap = WeightMap(model_shape(__import__("transformers").LlamaConfig(num_hidden_layers=1)))
    with pytest.raises(KeyError, match="self_attention.q_layernorm.weight"):
        wmap.hf_names("decoder.layers.0.self_attention.q_layernorm.weight")


def test_pipeline_stage_names_map_to_global_layers():
    assert layer_offset(1, num_layers=30, pp_size=2) == 15
    assert to_global_name("decoder.layers.3.mlp.linear_fc2.weight", 15) == (
        "decoder.layers.18.mlp.linear_fc2.weight"
    )
    assert to_global_name("decoder.final_layernorm.weight", 15) == "decoder.final_layernorm.weight"


def test_layouts_match_mbridge(hf_config, make_random_model):
    """mbridge (verl's bridge, TransformerEngine names) fuses and splits the same way."""
    bridge_mod = pytest.importorskip("mbridge.core.bridge", exc_type=ImportError)
    from types import SimpleNamespace

    bridge = object.__new__(bridge_mod.Bridge)
    bridge.hf_config, bridge.dtype, bridge.make_vocab_size_divisible_by = hf_config, None, None
    bridge.config = SimpleNamespace(gated_linear_unit=True)
    shape = model_shape(hf_config)
    wmap = WeightMap(shape, spec="te", tp_size=2)
    hf = _hf_state(make_random_model(hf_config))
    for name in ("decoder.layers.0.self_attention.linear_qkv.weight",
                 "decoder.layers.0.mlp.linear_fc1.weight"):  # fmt: skip
        tensors = [hf[n] for n in wmap.hf_names(name)]
        ours = wmap.to_megatron(name, tensors)
        torch.testing.assert_close(ours, bridge._weight_to_mcore_format(name, tensors))
        bridge.mpu = SimpleNamespace(tp_size=2)
        theirs = bridge._weight_split_across_tp(name, ours, ours[: ours.shape[0] // 2], 2)
        for a, b in zip(wmap.split_tp(name, ours), theirs, strict=True):
            torch.testing.assert_close(a, b)
