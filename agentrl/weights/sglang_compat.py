"""What agentrl takes from an installed SGLang, when there is one: the class a real SGLang server
accepts as flattened-bucket metadata, and its patch of torch's CUDA IPC reductions. The one place
outside the SGLang client that imports `sglang`; without it the sender falls back to what SGLang's
SafeUnpickler admits anyway (`types.SimpleNamespace`) and torch's own reductions."""

# pyright: reportMissingImports=false
# (sglang is an optional extra: a dev install leaves it out)
from __future__ import annotations

import contextlib
import functools


@functools.cache
def flattened_metadata_class() -> type | None:
    """SGLang's `FlattenedTensorMetadata` if importable here, else None. (A real server unpickles
    only allow-listed globals: its own class and SimpleNamespace, never agentrl's.)"""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except Exception:  # absent, or installed without what its package __init__ imports
        return None
    return FlattenedTensorMetadata


def patch_torch_reductions() -> None:
    """SGLang's patch (device UUIDs instead of ordinals in CUDA IPC handles), if installed. Only
    for CUDA tensors: the patched reduction indexes an argument CPU tensors do not have."""
    with contextlib.suppress(ImportError):
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
