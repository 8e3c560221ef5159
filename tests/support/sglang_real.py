"""SGLang's real code on a CPU machine, for the conformance suite (tests/engine/sglang_real):
where it is installed (`AGENTRL_SGLANG_PATH`, filled by scripts/ci_sglang.sh) and how to import it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

SGLANG_PATH_ENV = "AGENTRL_SGLANG_PATH"
SKIP_REASON = (
    f"{SGLANG_PATH_ENV} is unset: the SGLang conformance suite runs against SGLang's real code "
    "installed by `bash scripts/ci_sglang.sh` (one directory per pinned version)"
)


def sglang_path() -> str | None:
    """The directory that holds an installed SGLang (and its pure-Python needs), or None."""
    path = os.environ.get(SGLANG_PATH_ENV)
    if not path:
        return None
    if not (Path(path) / "sglang").is_dir():
        raise RuntimeError(
            f"{SGLANG_PATH_ENV}={path!r} holds no sglang package; run "
            "`bash scripts/ci_sglang.sh VERSION` to install one there"
        )
    return path


def _declare_torchvision_ops() -> None:
    """PyPI's torchvision is a CUDA build whose C library cannot load against CPU torch, but its
    Python part still registers fake kernels for `nms` and `qnms` at import, which needs the two
    ops declared. Declare them (schemas only, as torchvision's C library would), nothing more."""
    import torch

    if hasattr(_declare_torchvision_ops, "library"):
        return
    try:
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:  # a real torchvision C library is loaded: it declared them already
        return
    _declare_torchvision_ops.library = library  # type: ignore[attr-defined]  # keeps them alive


def import_sglang() -> ModuleType:
    """`sglang` from `AGENTRL_SGLANG_PATH` (put at the front of sys.path)."""
    path = sglang_path()
    if path is None:
        raise RuntimeError(SKIP_REASON)
    if path not in sys.path:
        sys.path.insert(0, path)
    _declare_torchvision_ops()
    import sglang

    return sglang


def sglang_version() -> str:
    from importlib.metadata import PathDistribution

    path = sglang_path()
    assert path is not None, SKIP_REASON
    (info,) = Path(path).glob("sglang-*.dist-info")
    return PathDistribution(info).version


def version_tuple(version: str) -> tuple[int, ...]:
    """'0.5.15.post1' -> (0, 5, 15): releases compare by their numeric parts."""
    return tuple(int(part) for part in version.split(".")[:3])
