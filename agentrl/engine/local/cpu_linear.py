"""Linear layers on CPU through oneDNN with prepacked weights, for the engine's forwards.

A plain `F.linear` in fp32 on CPU goes to MKL's sgemm, which repacks the whole weight into its
panel layout on every call: at decode sizes (a few rows) that repacking is most of the work, and on
AMD CPUs MKL does not take its AVX-512 paths at all. oneDNN with the weight reordered once into its
own blocked layout runs the same product 2-3x faster at 1-256 rows (`benchmarks/engine_cpu/`).

The packed copy sits beside the model's own weight (which `update_weights`, `state_dict` and the
trainer keep using) and is packed again whenever that weight changes in place (its version counter
moves) or moves (its storage changes). Only forwards inside `PackedLinears.active()` use it: a plain
call of the model (`generate()`, a teacher-forced check) stays transformers' own computation.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# oneDNN's packed layout depends only weakly on the row count it is told to expect; 64 ran as fast
# as an exact hint from 1 row (decode) to 1,024 rows (prefill) in benchmarks/engine_cpu/.
_ROWS_HINT = 64


def packing_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """fp32 on an x86 CPU with oneDNN (elsewhere the platform's BLAS is the better bet)."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and platform.machine().lower() in ("x86_64", "amd64")
    )


class _PackedForward:
    """The `forward` of one `nn.Linear`: oneDNN on the packed weight while its owner is active."""

    def __init__(self, owner: PackedLinears, linear: torch.nn.Linear) -> None:
        self.owner = owner
        self.linear = linear
        self.packed: torch.Tensor | None = None
        self.packed_from: tuple[int, int] = (-1, -1)  # (data_ptr, version) it was packed from

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (Linear.forward's name)
        weight = self.linear.weight
        bias = self.linear.bias
        if not getattr(self.owner.local, "is_active", False):
            return F.linear(input, weight, bias)
        source = (weight.data_ptr(), weight._version)
        if self.packed is None or source != self.packed_from:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT)
            self.packed_from = source
        return torch.ops.mkldnn._linear_pointwise(input, self.packed, bias, "none", [], "")

    def drop(self) -> None:
        self.packed = None
        self.packed_from = (-1, -1)


class PackedLinears:
    """Routes every `nn.Linear` of `model` through oneDNN on prepacked weights inside `active()`.

    Costs one more copy of the linear weights in host memory (packed lazily, at the first forward).
    """

    def __init__(self, model: Any) -> None:
        # Per thread: a plain call of the model from another thread, while the engine's worker is
        # inside a forward, stays transformers' own computation.
        self.local = threading.local()
        self._forwards: list[_PackedForward] = []
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                forward = _PackedForward(self, module)
                module.forward = forward  # an instance attribute: the class's forward is untouched
                self._forwards.append(forward)

    @classmethod
    def install(cls, model: Any) -> PackedLinears | None:
        """Packed linears for a CPU fp32 model where oneDNN can run them, else None (plain
        `F.linear`); a oneDNN build without the packing ops also gives None."""
        weight = next(model.parameters())
        if not packing_supported(weight.device, weight.dtype):
            return None
        try:  # a build whose oneDNN lacks the ops: plain linears, correct and slower
            probe = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8), _ROWS_HINT)
            torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 8), probe, None, "none", [], "")
        except (RuntimeError, AttributeError) as e:
            logger.info("LocalEngine: oneDNN linear unavailable (%s); plain F.linear on CPU", e)
            return None
        return cls(model)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self.local.is_active = True
        try:
            yield
        finally:
            self.local.is_active = False

    def drop(self) -> None:
        """Forget every packed copy (memory back; packed again at the next active forward)."""
        for forward in self._forwards:
            forward.drop()

    @property
    def nbytes(self) -> int:
        return sum(f.linear.weight.numel() * 4 for f in self._forwards if f.packed is not None)
