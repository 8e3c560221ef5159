"""A LoRA adapter on its way from trainer to engines, in the format both trainer backends export and
SGLang's `/load_lora_adapter_from_tensors` takes: tensors under PEFT's saved names
(`base_model.model.<HF module>.lora_A.weight`, A [r, in] and B [out, r]) and PEFT's
`adapter_config.json` as a dict; read back into one (A, B) pair per adapted HF weight; the name
each sync serves it under."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

PEFT_PREFIX = "base_model.model."
_A = ".lora_A.weight"
_B = ".lora_B.weight"


def adapter_name(version: int) -> str:
    """The name a sync loads the adapter of policy `version` under (SGLang's `lora_name`; a
    rollout request names it as `lora_path`)."""
    return f"agentrl-v{version}"


@dataclass
class AdapterExport:
    """The adapter as PEFT saves it and SGLang's `/load_lora_adapter_from_tensors` takes it. The
    format is stable: the torch and Megatron backends both export it."""

    named_tensors: list[tuple[str, Tensor]]
    config_dict: dict[str, Any]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named_tensors)

    @property
    def scaling(self) -> float:
        """alpha / r: plain LoRA, what both PEFT and SGLang merge with."""
        cfg = self.config_dict
        for flag in ("use_rslora", "use_dora"):
            if cfg.get(flag):
                raise ValueError(f"adapter config {flag}=true: only plain LoRA is merged here")
        return float(cfg["lora_alpha"]) / int(cfg["r"])

    def pairs(self) -> dict[str, tuple[Tensor, Tensor]]:
        """HF weight name (`model.layers.0.self_attn.q_proj.weight`) -> (A [r, in], B [out, r])."""
        halves: dict[str, dict[str, Tensor]] = {}
        for name, tensor in self.named_tensors:
            for suffix in (_A, _B):
                if name.startswith(PEFT_PREFIX) and name.endswith(suffix):
                    module = name[len(PEFT_PREFIX) : -len(suffix)]
                    halves.setdefault(f"{module}.weight", {})[suffix] = tensor
                    break
            else:
                raise ValueError(
                    f"adapter tensor {name!r} is not named as PEFT saves LoRA "
                    f"({PEFT_PREFIX}<module>{_A} or {_B})"
                )
        rank = int(self.config_dict["r"])
        out = {}
        for weight, pair in halves.items():
            a = pair.get(_A)
            b = pair.get(_B)
            if a is None or b is None or a.shape[0] != rank or b.shape[1] != rank:
                raise ValueError(
                    f"adapter of {weight}: needs lora_A [r={rank}, in] and lora_B [out, r={rank}], "
                    f"got {_shape(a)} and {_shape(b)}"
                )
            out[weight] = (a, b)
        return out


def _shape(t: Tensor | None) -> str:
    return "none" if t is None else str(list(t.shape))
