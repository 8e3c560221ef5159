"""SGLang's wire format for weights: the `flattened_bucket` (one dtype's tensors in one flat
buffer, with per-tensor metadata; as bytes for a broadcast) and its IPC serialization for
`/update_weights_from_tensor`.

Matches sgl-project/sglang `python/sglang/srt/weight_sync/tensor_bucket.py`,
`MultiprocessingSerializer` (`python/sglang/srt/utils`) and THUDM/slime
`slime/backends/megatron_utils/update_weight/update_weight_from_{tensor,distributed}.py`.
"""

from __future__ import annotations

import base64
import io
import threading
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def bucket_metadata(name: str, shape: Any, dtype: Any, start: int, end: int) -> Any:
    """One entry of a bucket's metadata, as a class a real SGLang server unpickles: its own
    `FlattenedTensorMetadata` when sglang is importable here, else `types.SimpleNamespace`
    (the other type its SafeUnpickler admits; SGLang reads the fields by name)."""
    from agentrl.weights.sglang_compat import flattened_metadata_class

    cls = flattened_metadata_class() or types.SimpleNamespace
    return cls(name=name, shape=shape, dtype=dtype, start_idx=start, end_idx=end, numel=end - start)


def flatten_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """One dtype's tensors -> {"flattened_tensor", "metadata"} (SGLang's `flattened_bucket`).

    Indices count elements of the bucket's own dtype (not bytes), which both the old
    (`.to(dtype)`) and new (`.view(dtype)`) SGLang reconstructions read correctly. The flat
    tensor is a fresh buffer per bucket (reusing one across buckets corrupts weights: slime):
    the one a packed bucket's tensors are views of (`buckets.packed_buckets`), else a new one.
    """
    dtypes = {t.dtype for _, t in named_tensors}
    if len(dtypes) != 1:
        raise ValueError(f"a flattened bucket holds one dtype, got {sorted(map(str, dtypes))}")
    metadata = []
    start = 0
    for name, t in named_tensors:
        metadata.append(bucket_metadata(name, t.shape, t.dtype, start, start + t.numel()))
        start += t.numel()
    flat = _flat([t for _, t in named_tensors])
    return {"flattened_tensor": flat, "metadata": metadata}


def flatten_into(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat buffer holding `tensors` (one dtype) back to back, in order, viewed as
    bytes: what SGLang's receiver allocates for a broadcast flattened bucket."""
    import torch

    return _flat(tensors).view(torch.uint8)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`tensors` back to back in one flat tensor: the buffer they are consecutive views of when
    they are (a packed bucket: no copy), else a fresh concatenation."""
    import torch

    base = flat_base(tensors)
    return base if base is not None else torch.cat([t.detach().reshape(-1) for t in tensors])


def flat_base(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D buffer that `tensors` exactly tile, in order and contiguous, or None."""
    base = tensors[0]._base if tensors else None
    if base is None or base.dim() != 1 or not base.is_contiguous():
        return None
    offset = base.storage_offset()
    for t in tensors:
        if t._base is not base or not t.is_contiguous() or t.storage_offset() != offset:
            return None
        offset += t.numel()
    return base.detach() if offset == base.storage_offset() + base.numel() else None


def reconstruct_bucket(bucket: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    flat = bucket["flattened_tensor"]
    out = []
    for m in bucket["metadata"]:
        t = flat[m.start_idx : m.end_idx]
        if t.dtype != m.dtype:  # a byte-view bucket (new SGLang) or a cast
            t = t.view(m.dtype) if t.dtype.itemsize == 1 else t.to(m.dtype)
        out.append((m.name, t.reshape(m.shape)))
    return out


_SHARING_LOCK = threading.Lock()


def serialize_for_ipc(obj: Any) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)`: a ForkingPickler dump,
    base64-encoded. CUDA tensors travel as CUDA IPC handles (what real SGLang expects); CPU tensors
    as shared-memory file names (`file_system` strategy), so the bytes never go over HTTP. Either
    way the receiver must be on the same host and the sender must keep the tensors alive until the
    request returns. SGLang's patch of the CUDA reductions (device UUIDs) is applied only for
    CUDA tensors: it rewrites an argument that CPU tensors' reductions do not have."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    from agentrl.weights.sglang_compat import patch_torch_reductions

    if _holds_cuda_tensor(obj):
        patch_torch_reductions()  # device UUIDs instead of ordinals, as SGLang does
    buf = io.BytesIO()
    with _SHARING_LOCK:
        old = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")
        try:
            ForkingPickler(buf).dump(obj)
        finally:
            tmp.set_sharing_strategy(old)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _holds_cuda_tensor(obj: Any) -> bool:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, dict):
        return any(_holds_cuda_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_cuda_tensor(v) for v in obj)
    return False
