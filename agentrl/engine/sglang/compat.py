"""What agentrl takes from an installed SGLang, when there is one: the class a real SGLang server
accepts as flattened-bucket metadata, and its patch of torch's CUDA IPC reductions. The one place
outside the client that imports `sglang`; without it both fall back to agentrl's own."""

from __future__ import annotations

import contextlib


def flattened_metadata_class(default: type) -> type:
    """SGLang's `FlattenedTensorMetadata` if installed (a real server unpickles only allow-listed
    modules, so the metadata must be its class), else `default`."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        return FlattenedTensorMetadata
    except ImportError:
        return default


def patch_torch_reductions() -> None:
    """SGLang's patch (device UUIDs instead of ordinals in CUDA IPC handles), if installed."""
    with contextlib.suppress(ImportError):
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
