"""LoRA on the torch backend, through PEFT (the field's library): the adapter config from
`train.lora_*`, the adapters put into a transformers model in place (its base frozen), and what
leaves the trainer: the merged weights under the base's HF names (what every engine loads today)
and the adapter alone with its PEFT config (what SGLang's `/load_lora_adapter_from_tensors`
takes), gathered whole from FSDP2 shards one tensor at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from agentrl.config import ConfigError, TrainConfig
from agentrl.weights.adapter import AdapterExport
from agentrl.weights.export import full_tensor

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel
    from transformers import PreTrainedModel

ADAPTER = "default"  # PEFT's name for a model's one adapter
ADAPTER_CONFIG_FILE = "adapter_config.json"  # what PeftModel.from_pretrained reads
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ALL_LINEAR = "all-linear"

MEGATRON_NAMES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""Megatron(-Bridge) module names, as verl's and Megatron-Bridge's LoRA configs write them, ->
the HF Llama/Qwen projections they fuse."""

PEFT_MISSING = "--lora-rank needs peft, which is not installed: pip install 'agentrl[lora]'"


def hf_target_modules(names: list[str]) -> str | list[str]:
    """`train.lora_target_modules` in PEFT's terms: `all-linear` as is (every linear layer but
    the output head), Megatron names as the HF projections they stand for."""
    if names == [ALL_LINEAR]:
        return ALL_LINEAR
    out: list[str] = []
    for name in names:
        out += [n for n in MEGATRON_NAMES.get(name, (name,)) if n not in out]
    return out


def make_lora_config(cfg: TrainConfig) -> LoraConfig:
    """PEFT's `LoraConfig` of `train.lora_*` (`cfg.lora_rank` > 0). Plain LoRA: no DoRA, no
    rsLoRA, no trained bias, so the merged weight is exactly W + alpha / r * B @ A."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise ConfigError(PEFT_MISSING) from None
    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=hf_target_modules(cfg.lora_target_modules),
        bias="none",
    )


def apply_lora(model: PreTrainedModel, config: LoraConfig, *, seed: int) -> PeftModel:
    """Put `config`'s adapters into `model` in place and freeze everything else; returns the
    `PeftModel` around it (its `disable_adapter()` gives the base model back for a while).

    The A matrices are drawn from `seed` (B starts at 0): every rank draws the same ones, as FSDP
    expects of the tensors it shards, and a run reproduces on any number of ranks."""
    from peft import get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    try:
        # The caller's generators are left as they were (the CPU's and the model's GPU's).
        device = next(model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            peft_model = get_peft_model(model, config)  # type: ignore[arg-type]
    except ValueError:  # PEFT's "Target modules {...} not found in the base model"
        raise ConfigError(
            f"train.lora_target_modules={_as_list(config.target_modules)} matches no layer of "
            f"this model; use all-linear or some of: {','.join(_linear_names(model))}"
        ) from None
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not isinstance(module, LoraLinear):
            raise ConfigError(
                f"train.lora_target_modules reaches {name} ({type(module).__name__}): LoRA here "
                "trains linear layers only; name linear projections, or use all-linear"
            )
        if isinstance(module, LoraLinear) and module.fan_in_fan_out:
            raise ConfigError(f"{name} stores its weight transposed (Conv1D): not supported yet")
    return peft_model


def _linear_names(model: PreTrainedModel) -> list[str]:
    """Short names of the linear layers an adapter may go into (not the output head)."""
    head = model.get_output_embeddings()
    linear = {
        n.rpartition(".")[2]
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    }
    return sorted(linear)


def _as_list(target: Any) -> list[str]:
    return [target] if isinstance(target, str) else sorted(target or ())


def _lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def merged_named_tensors(
    model: torch.nn.Module, *, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, Tensor]]:
    """(HF name, whole tensor) of the model with its adapter merged: every adapted linear's weight
    is W + scaling * B @ A (in float32, then `dtype`), named as in the base checkpoint; the
    adapter's own tensors are not sent. Lazy and collective under FSDP, as `unique_named_tensors`
    (every rank iterates to the end; a tied lm_head once)."""
    layers = _lora_layers(model)
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if ".lora_" in name or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        owner, _, leaf = name.rpartition(".")
        base_owner = owner.removesuffix(".base_layer")
        whole = full_tensor(tensor.detach())
        if base_owner != owner and leaf == "weight":
            whole = _merged(whole, layers[base_owner])
        if dtype is not None and whole.is_floating_point():
            whole = whole.to(dtype)
        yield f"{base_owner}.{leaf}", whole


def _merged(weight: Tensor, layer: Any) -> Tensor:
    a = full_tensor(layer.lora_A[ADAPTER].weight.detach()).float()  # [r, in]
    b = full_tensor(layer.lora_B[ADAPTER].weight.detach()).float()  # [out, r]
    return (weight.float() + layer.scaling[ADAPTER] * (b @ a)).to(weight.dtype)


def export_adapter(
    peft_model: PeftModel, *, base_model_path: str, dtype: torch.dtype | None = None
) -> AdapterExport:
    """The adapter's tensors, whole (gathered from FSDP shards: collective), in `dtype`, and its
    PEFT config naming `base_model_path`."""
    from peft import get_peft_model_state_dict

    state = {}
    for name, tensor in peft_model.state_dict(keep_vars=True).items():
        if ".lora_" in name:
            whole = full_tensor(tensor.detach())
            state[name] = whole.to(dtype) if dtype is not None else whole
    saved = get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=ADAPTER)
    return AdapterExport(list(saved.items()), adapter_config_dict(peft_model, base_model_path))


def adapter_config_dict(peft_model: PeftModel, base_model_path: str) -> dict[str, Any]:
    """PEFT's config as JSON values. The target modules as their short names (`q_proj`), which
    PEFT matches as suffixes (the same layers) and SGLang expects; PEFT resolves all-linear to
    every full module path instead."""
    config = peft_model.peft_config[ADAPTER].to_dict()
    config["target_modules"] = sorted({n.rpartition(".")[2] for n in _lora_layers(peft_model)})
    config["base_model_name_or_path"] = base_model_path
    config["inference_mode"] = True
    return json.loads(json.dumps(config, default=_json_value))


def _json_value(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def save_adapter(out: Path, adapter: AdapterExport) -> None:
    """A PEFT adapter directory: `PeftModel.from_pretrained(base, out)` (or transformers with
    peft installed, or SGLang's --lora-paths) loads it."""
    from safetensors.torch import save_file

    tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in adapter.named_tensors}
    save_file(tensors, str(out / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    text = json.dumps(adapter.config_dict, indent=2, sort_keys=True)
    (out / ADAPTER_CONFIG_FILE).write_text(text, encoding="utf-8")


def num_adapter_params(model: torch.nn.Module) -> int:
    """Elements of the adapter (whole, not this rank's shard)."""
    return sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)


def lora_key(cfg: TrainConfig) -> dict[str, Any] | None:
    """What a checkpoint's adapter must match to be resumed (both backends)."""
    if not cfg.lora_rank:
        return None
    return {
        "rank": cfg.lora_rank,
        "alpha": cfg.lora_alpha,
        "target_modules": cfg.lora_target_modules,
    }
