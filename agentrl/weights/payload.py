"""What a weight payload may name and do before `receive.py` unpickles it: the allow-list of
globals (SGLang's), the few of them it may call or set the state of, and the opcode walk that
checks both and bounds what the payload may map or allocate."""

from __future__ import annotations

import pickle
import pickletools
from dataclasses import dataclass
from typing import Any


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
SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
SGLANG_CUDA_REBUILD = ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")
TORCH_STORAGE_FROM_BYTES = ("torch.storage", "_load_from_bytes")
_MAPPED = frozenset({SGLANG_METADATA, SGLANG_CUDA_REBUILD, TORCH_STORAGE_FROM_BYTES})
_REDUCTIONS = "torch.multiprocessing.reductions"
# What a payload may call (REDUCE, NEWOBJ, OBJ, INST): the rebuilds SGLang's serializer and
# agentrl's emit (ForkingPickler: CPU tensors by shared-memory file or fd, CUDA by IPC handle;
# plain pickle: torch._utils), the Size/device/metadata they carry. The allow-list admits more
# (bytearray, deque, itertools.repeat, functools.partial...) because SGLang's does, but calling
# those allocates what the payload asks for (`deque(repeat(0, 10**10), 0)`, 63 bytes, froze
# `agentrl serve` 20 s; `bytearray(10**9)`, 36 bytes, took 1 GB) or calls through to any global
# (functools.partial). Rebuilds that call a function they are handed (nested, sparse,
# _rebuild_from_type_v2), allocate their declared shape (_rebuild_qtensor) or load a nested
# pickle (torch.storage._load_from_bytes: torch's weights_only load admits bytearray) are left
# out: ForkingPickler payloads never hold them.
_CALLED_MP_REBUILDS = (
    "rebuild_tensor rebuild_meta_tensor rebuild_cuda_tensor rebuild_storage_fd "
    "rebuild_storage_filename rebuild_storage_empty rebuild_typed_storage rebuild_typed_storage_child"
)
_CALLED_TORCH_UTILS = (
    "_rebuild_tensor _rebuild_tensor_v2 _rebuild_tensor_v3 _rebuild_parameter "
    "_rebuild_meta_tensor_no_storage"
)
CALLABLE_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {(_REDUCTIONS, n) for n in _words(_CALLED_MP_REBUILDS)}
    | {("torch._utils", n) for n in _words(_CALLED_TORCH_UTILS)}
    | {SGLANG_CUDA_REBUILD, SGLANG_METADATA, ("types", "SimpleNamespace")}
    | {("torch", "Size"), ("torch", "device"), ("collections", "OrderedDict")}
    | {("multiprocessing.resource_sharer", "DupFd")}
)
# What BUILD may set the state of: the bucket metadata and fd handles, plain objects.
BUILDABLE_GLOBALS = frozenset(
    {SGLANG_METADATA, ("types", "SimpleNamespace"), ("multiprocessing.resource_sharer", "DupFd")}
)
# The argument that declares a rebuilt storage's size: the bytes it maps (a shared-memory file
# the receiver grows to that size, a CUDA IPC block).
_SIZE_ARGUMENT = {
    (_REDUCTIONS, "rebuild_storage_filename"): 3,
    (_REDUCTIONS, "rebuild_storage_fd"): 2,
    (_REDUCTIONS, "rebuild_cuda_tensor"): 8,
    SGLANG_CUDA_REBUILD: 8,
}
MAX_PAYLOAD_BYTES = 16 << 30
"""The most storage one payload may map: a bucket is `update_weight_buffer_size` (2 GiB by
default) or one tensor larger than that (Llama-3-405B's fp32 embedding: 8.4 GB)."""
_IN_PLACE = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS"})
_REFUSED_OPCODES = frozenset(
    {"PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"}
)
_MARK = object()


def check_global(module: str, name: str) -> None:
    """`UnpicklingError` unless (module, name) is on the allow-list (or mapped to our own)."""
    if (module, name) not in ALLOWED_GLOBALS | _MAPPED:
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name} in a weight payload: only torch tensor, "
            "storage and dtype globals and FlattenedTensorMetadata are allowed"
        )


@dataclass(frozen=True)
class _Global:
    module: str
    name: str


@dataclass(frozen=True)
class _Made:
    """An object a call made: which global made it (BUILD asks)."""

    by: _Global


def check_payload(data: bytes, max_bytes: int = MAX_PAYLOAD_BYTES) -> None:
    """Walk `data`'s opcodes (nothing is built) and refuse, with `UnpicklingError`, a payload
    that names a global off the allow-list, calls anything but `CALLABLE_GLOBALS`, sets the state
    of anything but `BUILDABLE_GLOBALS`, maps more than `max_bytes` of storage, or asks the
    unpickler's memo for a slot far past its last (`LONG_BINPUT 2**32-1`: a 32 GiB memo)."""
    walk = _PayloadWalk(max_bytes)
    try:
        for opcode, arg, _ in pickletools.genops(data):
            walk.step(opcode, arg)
    except (ValueError, IndexError) as e:  # truncated data, a stack underflow, no MARK
        raise pickle.UnpicklingError(f"malformed weight payload: {e}") from None


class _PayloadWalk:
    """The unpickler's stack played with symbols: strings, ints and tuples as themselves,
    globals and what calls made as `_Global`/`_Made`, anything else None."""

    def __init__(self, max_bytes: int) -> None:
        self.stack: list[Any] = []
        self.memo: list[Any] = []
        self.max_bytes = max_bytes
        self.declared_bytes = 0

    def step(self, opcode: pickletools.OpcodeInfo, arg: Any) -> None:
        name = opcode.name
        if name in _REFUSED_OPCODES:
            raise pickle.UnpicklingError(f"refusing opcode {name} in a weight payload")
        if name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            self._memoize(len(self.memo) if name == "MEMOIZE" else int(arg))
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if not 0 <= int(arg) < len(self.memo):
                raise pickle.UnpicklingError(f"weight payload reads memo slot {arg}, never set")
            self.stack.append(self.memo[int(arg)])
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            self.stack.append(self._global(arg))
        elif name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX"):
            if name == "NEWOBJ_EX":
                self.stack.pop()  # kwargs
            args = self.stack.pop()
            self._call(self.stack.pop(), args)
        elif name in ("INST", "OBJ"):
            items = self._pop_to_mark()
            fn = self._global(arg) if name == "INST" else items.pop(0)
            self._call(fn, tuple(items))
        elif name == "BUILD":
            self.stack.pop()
            made = self.stack[-1]
            if not (isinstance(made, _Made) and _pair(made.by) in BUILDABLE_GLOBALS):
                raise pickle.UnpicklingError(
                    f"refusing to set the state of {_describe(made)} in a weight payload"
                )
        elif name.startswith("TUPLE") or name == "EMPTY_TUPLE":
            count = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "EMPTY_TUPLE": 0}.get(name)
            items = self._pop_to_mark() if count is None else self._pop(count)
            self.stack.append(tuple(items))
        else:
            self._other(opcode, arg)

    def _other(self, opcode: pickletools.OpcodeInfo, arg: Any) -> None:
        before = opcode.stack_before
        if pickletools.markobject in before:
            self._pop_to_mark()
            before = before[: before.index(pickletools.markobject)]
        popped = self._pop(len(before))
        if opcode.name in _IN_PLACE:
            self.stack.append(popped[0])  # the list, dict or set, filled
            return
        for kind in opcode.stack_after:
            is_constant = isinstance(arg, (str, int)) and kind is not pickletools.markobject
            self.stack.append(
                _MARK if kind is pickletools.markobject else arg if is_constant else None
            )

    def _global(self, arg: Any) -> _Global:
        if arg is None:  # STACK_GLOBAL: the two strings under it
            module, name = self._pop(2)
            if not (isinstance(module, str) and isinstance(name, str)):
                raise pickle.UnpicklingError("weight payload names a global by a computed name")
        else:
            module, name = str(arg).split(" ", 1)
        check_global(module, name)
        return _Global(module, name)

    def _call(self, fn: Any, args: Any) -> None:
        if not (isinstance(fn, _Global) and _pair(fn) in CALLABLE_GLOBALS):
            raise pickle.UnpicklingError(
                f"refusing to call {_describe(fn)} in a weight payload: only torch's tensor and "
                "storage rebuilds, torch.Size, torch.device and the bucket metadata are called"
            )
        index = _SIZE_ARGUMENT.get(_pair(fn))
        if index is not None:
            self._declare(fn, args, index)
        self.stack.append(_Made(fn))

    def _declare(self, fn: _Global, args: Any, index: int) -> None:
        size = args[index] if isinstance(args, tuple) and len(args) > index else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise pickle.UnpicklingError(
                f"weight payload calls {fn.module}.{fn.name} without a literal storage size"
            )
        has_dtype = fn.name in ("rebuild_storage_fd", "rebuild_storage_filename")
        dtype = args[index + 1] if has_dtype and len(args) > index + 1 else None
        self.declared_bytes += size * _itemsize(dtype)
        if self.declared_bytes > self.max_bytes:
            raise pickle.UnpicklingError(
                f"weight payload maps {self.declared_bytes} bytes of storage, over the bound of "
                f"{self.max_bytes} (max_bytes); send smaller buckets (update_weight_buffer_size)"
            )

    def _memoize(self, index: int) -> None:
        if not 0 <= index <= len(self.memo):  # picklers number memo slots 0, 1, 2, ...
            raise pickle.UnpicklingError(
                f"weight payload puts memo slot {index} after {len(self.memo)} slots"
            )
        top = self.stack[-1]
        if index == len(self.memo):
            self.memo.append(top)
        else:
            self.memo[index] = top

    def _pop(self, count: int) -> list[Any]:
        if count > len(self.stack) or _MARK in self.stack[len(self.stack) - count :]:
            raise IndexError("stack underflow")
        popped = self.stack[len(self.stack) - count :]
        del self.stack[len(self.stack) - count :]
        return popped

    def _pop_to_mark(self) -> list[Any]:
        marks = [i for i, v in enumerate(self.stack) if v is _MARK]
        if not marks:
            raise IndexError("no MARK on the stack")
        items = self.stack[marks[-1] + 1 :]
        del self.stack[marks[-1] :]
        return items


def _pair(g: _Global) -> tuple[str, str]:
    return (g.module, g.name)


def _describe(value: Any) -> str:
    if isinstance(value, _Global):
        return f"{value.module}.{value.name}"
    if isinstance(value, _Made):
        return f"an object made by {value.by.module}.{value.by.name}"
    return "a computed object"


def _itemsize(dtype: Any) -> int:
    """Bytes per element of a storage rebuilt with `dtype` (None: an untyped, byte storage)."""
    if dtype is None:
        return 1
    import torch

    found = getattr(torch, dtype.name, None) if isinstance(dtype, _Global) else None
    return found.itemsize if isinstance(found, torch.dtype) else 16  # the widest, if unknown
