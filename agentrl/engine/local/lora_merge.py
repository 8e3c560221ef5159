"""The embedded engine's LoRA adapter: one adapter at a time, merged into the engine's own weights
in place (W = W_base + alpha/r · B·A). The fused q/k/v and gate/up weights of `fused_model.py` are
views over the member projections, so writing `q_proj.weight` writes its slice of the fused one,
and the CPU's packed linears repack when a weight's version counter moves."""

from __future__ import annotations

import torch

from agentrl.weights.adapter import AdapterExport


class MergedAdapter:
    """Which adapter is merged into the engine's weights, and the base of each weight it touched.

    Why a base copy (on the host) instead of a delta (W += s·(B'A' − BA)): a delta rounds W to its
    dtype at every sync, so in bf16 each sync adds an ulp-sized error and the engine drifts away
    from the trainer's merge, which rounds once; with the base every merge is
    cast(W_base + s·B·A) computed in float32, bit for bit the trainer's `merged_named_tensors`.
    The cost is host memory for the adapted weights (with all-linear about 80% of a model whose
    embedding is tied), none on the accelerator."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.base: dict[str, torch.Tensor] = {}  # HF weight name -> its base, on the host

    def check(self, adapter: AdapterExport, weights: dict[str, torch.Tensor]) -> None:
        """One-line errors for an adapter this model cannot take (before anything is written)."""
        for name, (a, b) in adapter.pairs().items():
            if name not in weights:
                raise ValueError(
                    f"load_lora_adapter: {name!r} is not a weight of this model; the adapter "
                    "must be trained on the model the engine serves"
                )
            if (b.shape[0], a.shape[1]) != tuple(weights[name].shape):
                raise ValueError(
                    f"load_lora_adapter: B·A of {name} is {[b.shape[0], a.shape[1]]}, the weight "
                    f"is {list(weights[name].shape)}"
                )

    def merge(
        self, name: str, adapter: AdapterExport, weights: dict[str, torch.Tensor]
    ) -> list[torch.Tensor]:
        """Write cast(W_base + s·B·A) into every adapted weight and the base back into any weight
        the previous adapter touched and this one does not; returns the weights written."""
        pairs = adapter.pairs()
        scaling = adapter.scaling
        written = [self._restore(n, weights[n]) for n in list(self.base) if n not in pairs]
        with torch.no_grad():
            for weight_name, (a, b) in pairs.items():
                target = weights[weight_name]
                base = self.base.get(weight_name)
                if base is None:  # the first adapter: the engine's weights are the base
                    base = self.base[weight_name] = target.detach().to("cpu", copy=True)
                delta = b.to(target.device).float() @ a.to(target.device).float()  # [out, in]
                merged = base.to(target.device).float() + scaling * delta
                target.copy_(merged.to(target.dtype))
                written.append(target)
        self.name = name
        return written

    def unmerge(self, weights: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The base back into every weight the adapter touched."""
        written = [self._restore(n, weights[n]) for n in self.base]
        self.name = None
        return written

    def _restore(self, name: str, target: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target.copy_(self.base[name].to(target.device))
        return target
