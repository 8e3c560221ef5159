"""The engine's side of a weight update: payloads of `/update_weights_from_tensor` unpickled under
an allow-list, checkpoint directories read for `/update_weights_from_disk`, and the broadcast of
`/update_weights_from_distributed` received. The format and the sender's side live in
`agentrl.engine.weight_transport`."""

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

from agentrl.engine.weight_transport import reconstruct_bucket


def _words(text: str) -> list[str]:
    return text.split()


# The globals SGLang 0.5.23's `SafeUnpickler` (sglang/srt/utils/common.py) lets a weight payload
# name, as exact (module, name) pairs: a payload one server takes, the other takes too. A prefix
# ("torch.") or a dotted name would reach os.system through torch's own imports.
_TENSOR_KINDS = _words("BFloat16 Bool Byte Char Double Float Half Int Long Short")
_SPARSE_KINDS = [k for k in _TENSOR_KINDS if k != "Bool"]
_STORAGE_KINDS = (*_TENSOR_KINDS, "ComplexDouble", "ComplexFloat")
_DTYPES = _words(
    "bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 bool cdouble cfloat chalf complex128 "
    "complex32 complex64 double float float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn "
    "float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu half int int1 int16 int2 int3 "
    "int32 int4 int5 int6 int64 int7 int8 long qint32 qint8 quint2x4 quint4x2 quint8 short uint1 "
    "uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8 bcomplex32"
)
_BUILTINS = "bool bytearray bytes complex dict float frozenset int list range set slice str tuple"
_TORCH_UTILS = (
    "_rebuild_tensor _rebuild_tensor_v2 _rebuild_tensor_v3 _rebuild_parameter "
    "_rebuild_parameter_with_state _rebuild_qtensor _rebuild_sparse_tensor "
    "_rebuild_meta_tensor_no_storage _rebuild_wrapper_subclass _rebuild_device_tensor_from_numpy "
    "_rebuild_device_tensor_from_cpu_tensor"
)
_MP_REBUILDS = (
    "rebuild_tensor rebuild_meta_tensor rebuild_cuda_tensor rebuild_nested_tensor "
    "rebuild_sparse_coo_tensor rebuild_sparse_compressed_tensor rebuild_storage_fd "
    "rebuild_storage_filename rebuild_storage_empty rebuild_typed_storage "
    "rebuild_typed_storage_child"
)
_QSCHEMES = "per_tensor_affine per_tensor_symmetric per_channel_affine per_channel_symmetric"

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("builtins", n) for n in _words(_BUILTINS)}
    | {("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")}
    | {("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"), ("functools", "partial")}
    | {("itertools", "chain"), ("itertools", "repeat"), ("_codecs", "encode")}
    | {("multiprocessing.reduction", "_rebuild_partial")}
    | {("multiprocessing.reduction", "_rebuild_socket")}
    | {("multiprocessing.resource_sharer", "DupFd"), ("types", "SimpleNamespace")}
    | {(m, f"{k}Tensor") for m in ("torch", "torch.cuda") for k in _TENSOR_KINDS}
    | {(m, f"{k}Tensor") for m in ("torch.sparse", "torch.cuda.sparse") for k in _SPARSE_KINDS}
    | {("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype")}
    | {("torch", n) for n in _DTYPES}
    | {("torch", n) for n in (*_words(_QSCHEMES), "per_channel_affine_float_qparams")}
    | {("torch.nn.parameter", "Parameter"), ("torch.serialization", "_get_layout")}
    | {("torch._utils", n) for n in _words(_TORCH_UTILS)}
    | {("torch._tensor", "_rebuild_from_type_v2")}
    | {("torch.storage", n) for n in ("UntypedStorage", "_UntypedStorage", "TypedStorage")}
    | {("torch", "UntypedStorage")}
    | {("torch", f"{k}Storage") for k in _STORAGE_KINDS}
    | {("torch", f"{k}Storage") for k in ("QInt32", "QInt8", "QUInt2x4", "QUInt4x2", "QUInt8")}
    | {("torch.cuda", f"{k}Storage") for k in _STORAGE_KINDS}
    | {("torch.multiprocessing.reductions", n) for n in _words(_MP_REBUILDS)}
)
# Names a sender may pickle that resolve to other code here (sglang need not be installed):
# SGLang's bucket metadata becomes a SimpleNamespace of its fields (start_idx, end_idx, ...).
_SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
_SGLANG_CUDA_REBUILD = ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")
_TORCH_STORAGE_FROM_BYTES = ("torch.storage", "_load_from_bytes")


class WeightUnpickler(pickle.Unpickler):
    """Resolves only `ALLOWED_GLOBALS` and the bucket metadata classes, each by its exact
    (module, name): what a flattened bucket of torch tensors (CUDA IPC or shared memory) needs.
    Anything else raises `UnpicklingError` before it can run."""

    def find_class(self, module: str, name: str) -> Any:
        pair = (module, name)
        if pair == _SGLANG_METADATA:
            return types.SimpleNamespace
        if pair == _SGLANG_CUDA_REBUILD:
            return _rebuild_cuda_tensor_by_uuid
        if pair == _TORCH_STORAGE_FROM_BYTES:  # torch's own helper runs an unrestricted load
            return _load_storage_from_bytes
        if pair not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(
                f"refusing to unpickle {module}.{name} in a weight payload: only torch tensor, "
                "storage and dtype globals and FlattenedTensorMetadata are allowed"
            )
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


def deserialize_named_tensors(serialized: str, load_format: str | None) -> list[tuple[str, Any]]:
    import torch.multiprocessing  # noqa: F401  (registers the tensor rebuild reductions)

    obj = WeightUnpickler(io.BytesIO(base64.b64decode(serialized, validate=True))).load()
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

    spans, offset = [], 0
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
