"""The engine's side of a weight update (what `agentrl serve` applies): payloads of
`/update_weights_from_tensor` walked opcode by opcode (`payload.py`), then unpickled under an
allow-list; checkpoint directories read for `/update_weights_from_disk`; the broadcast of
`/update_weights_from_distributed` received. The format is `wire.py`'s."""

from __future__ import annotations

import base64
import glob
import importlib
import io
import math
import os
import pickle
import types
from typing import Any

from agentrl.weights.payload import (
    ALLOWED_GLOBALS,
    MAX_PAYLOAD_BYTES,
    SGLANG_CUDA_REBUILD,
    SGLANG_METADATA,
    TORCH_STORAGE_FROM_BYTES,
    check_global,
    check_payload,
)
from agentrl.weights.wire import reconstruct_bucket

__all__ = ["ALLOWED_GLOBALS", "WeightUnpickler", "deserialize_named_tensors"]


class WeightUnpickler(pickle.Unpickler):
    """Resolves only `ALLOWED_GLOBALS` and the bucket metadata classes, each by its exact
    (module, name): what a flattened bucket of torch tensors (CUDA IPC or shared memory) needs.
    Anything else raises `UnpicklingError` before it can run."""

    def find_class(self, module: str, name: str) -> Any:
        pair = (module, name)
        if pair == SGLANG_METADATA:
            return types.SimpleNamespace
        if pair == SGLANG_CUDA_REBUILD:
            return _rebuild_cuda_tensor_by_uuid
        if pair == TORCH_STORAGE_FROM_BYTES:  # torch's own helper runs an unrestricted load
            return _load_storage_from_bytes
        check_global(module, name)
        # No super().find_class: it follows dotted names and remaps protocol-2 module names.
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise pickle.UnpicklingError(
                f"refusing to unpickle {module}.{name}: not in this torch ({e})"
            ) from None


def _rebuild_cuda_tensor_by_uuid(*args: Any) -> Any:
    """SGLang's `_rebuild_cuda_tensor_modified`: its sender names the GPU by UUID (argument 6)."""
    import torch
    from torch.multiprocessing import reductions

    device = args[6]
    if isinstance(device, str):
        uuids = [
            str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
        ]
        if device not in uuids:
            raise pickle.UnpicklingError(f"no GPU here has device_uuid={device!r}")
        args = (*args[:6], uuids.index(device), *args[7:])
    rebuild = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    return rebuild(*args)


def _load_storage_from_bytes(data: bytes) -> Any:
    import torch

    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


def deserialize_named_tensors(
    serialized: str, load_format: str | None, *, max_bytes: int = MAX_PAYLOAD_BYTES
) -> list[tuple[str, Any]]:
    """A base64 payload (SGLang's `MultiprocessingSerializer`) -> named tensors, after
    `check_payload`; `UnpicklingError` names what was refused."""
    import torch.multiprocessing  # noqa: F401  (registers the tensor rebuild reductions)

    data = base64.b64decode(serialized, validate=True)
    check_payload(data, max_bytes)
    obj = WeightUnpickler(io.BytesIO(data)).load()
    if load_format == "flattened_bucket":
        return reconstruct_bucket(obj)
    if load_format is None and isinstance(obj, (list, tuple)):
        return [(str(n), t) for n, t in obj]
    raise ValueError(
        f"load_format={load_format!r} is not supported; use 'flattened_bucket' or null"
    )


def load_checkpoint_tensors(model_path: str) -> list[tuple[str, Any]]:
    """A transformers checkpoint directory -> named tensors (safetensors, else *.bin)."""
    import torch
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if files:
        return [kv for f in files for kv in load_file(f).items()]
    files = sorted(glob.glob(os.path.join(model_path, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors or pytorch_model*.bin in model_path={model_path!r}"
        )
    return [
        kv for f in files for kv in torch.load(f, map_location="cpu", weights_only=True).items()
    ]


def receive_broadcast(
    pg: Any,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    device: Any = "cpu",
    *,
    load_format: str | None = None,
) -> list[tuple[str, Any]]:
    """The engine side of update_weights_from_distributed, as SGLang 0.5.23's model runner does
    it: `flattened_bucket` receives the whole bucket as bytes in one broadcast
    (`FlattenedTensorBucket.empty`) and views it per name; otherwise one broadcast per tensor,
    all in flight together."""
    import torch
    import torch.distributed as dist

    torch_dtypes = [getattr(torch, d) for d in dtypes]
    if load_format == "flattened_bucket":
        flat, views = _empty_byte_bucket(names, torch_dtypes, shapes, device)
        dist.broadcast(flat, 0, group=pg)
        return views
    if load_format is not None:
        raise ValueError(
            f"load_format={load_format!r} is not supported; use 'flattened_bucket' or null"
        )
    named = [
        (name, torch.empty(shape, dtype=dtype, device=device))
        for name, dtype, shape in zip(names, torch_dtypes, shapes, strict=True)
    ]
    works = [dist.broadcast(t, 0, group=pg, async_op=True) for _, t in named]
    for work in works:
        if work is None:  # torch returns no Work to a rank outside the group
            raise RuntimeError("this engine rank is not in the weight update process group")
        work.wait()
    return named


def _empty_byte_bucket(
    names: list[str], dtypes: list[Any], shapes: list[list[int]], device: Any
) -> tuple[Any, list[tuple[str, Any]]]:
    """One uint8 buffer holding the tensors back to back, and each tensor's view of it; a tensor
    must start at a multiple of its item size (SGLang refuses an unaligned bucket too)."""
    import torch

    spans = []
    offset = 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if any(dim < 0 for dim in shape):
            raise ValueError(f"negative dimension in received tensor {name}: shape={shape}")
        if offset % dtype.itemsize:
            raise ValueError(
                f"unaligned received tensor {name}: byte offset {offset}, dtype {dtype}; order "
                "the bucket's tensors by item size, largest first"
            )
        size = math.prod(shape) * dtype.itemsize
        spans.append((name, dtype, shape, offset, size))
        offset += size
    if not spans:
        raise ValueError("a flattened bucket needs at least one tensor")
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    views = [(n, flat[o : o + z].view(d).reshape(s)) for n, d, s, o, z in spans]
    return flat, views
