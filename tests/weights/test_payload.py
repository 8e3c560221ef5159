"""The opcode walk before a weight payload is unpickled: payloads built only of allow-listed
globals that allocate what they ask for (`bytearray(10**9)`, `deque(repeat(0, 10**10), 0)`), grow
the memo, map a huge shared-memory storage or set the state of a torch object are refused before
anything is built; real payloads (agentrl's sender, SGLang's dataclass metadata, fd sharing) load."""

from __future__ import annotations

import base64
import dataclasses
import io
import pickle
import struct
import sys
import types
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing

from agentrl.weights.payload import check_payload
from agentrl.weights.receive import deserialize_named_tensors
from agentrl.weights.wire import flatten_bucket, serialize_for_ipc


def _str(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def _global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + b"\x93"  # STACK_GLOBAL


def _int(value: int) -> bytes:
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data  # LONG1


def _call(fn: bytes, *args: bytes) -> bytes:
    return fn + b"(" + b"".join(args) + b"tR"  # MARK args TUPLE REDUCE


def _pickle(body: bytes) -> str:
    return base64.b64encode(b"\x80\x04" + body + b".").decode()


BYTEARRAY_BOMB = _pickle(_call(_global("builtins", "bytearray"), _int(10**9)))
DEQUE_BOMB = _pickle(
    _call(
        _global("collections", "deque"),
        _call(_global("itertools", "repeat"), _int(0), _int(10**10)),
        _int(0),
    )
)


@pytest.mark.parametrize(
    ("payload", "called"),
    [(BYTEARRAY_BOMB, "builtins.bytearray"), (DEQUE_BOMB, "itertools.repeat")],
    ids=["bytearray", "deque_repeat"],
)
def test_allocation_bombs_of_allow_listed_globals_are_refused(payload: str, called: str) -> None:
    assert len(base64.b64decode(payload)) < 80
    with pytest.raises(pickle.UnpicklingError, match=f"refusing to call {called}"):
        deserialize_named_tensors(payload, "flattened_bucket")


def test_partial_cannot_call_through_to_another_global() -> None:
    inner = _global("builtins", "bytearray")
    payload = _pickle(_call(_call(_global("functools", "partial"), inner, _int(10**9))))
    with pytest.raises(pickle.UnpicklingError, match="refusing to call functools.partial"):
        deserialize_named_tensors(payload, None)


def test_a_memo_slot_far_past_the_last_is_refused() -> None:
    payload = base64.b64encode(b"\x80\x04N" + b"r" + struct.pack("<I", 2**32 - 1) + b".")
    with pytest.raises(pickle.UnpicklingError, match="memo slot 4294967295"):
        deserialize_named_tensors(payload.decode(), None)


def test_a_huge_shared_memory_storage_is_refused_by_its_declared_size() -> None:
    """rebuild_storage_filename grows the named shm file to the declared size: 10 TB asked."""
    storage = _call(
        _global("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        _global("torch.storage", "UntypedStorage"),
        b"C\x04sock",
        b"C\x05/nope",
        _int(10**13),
    )
    with pytest.raises(pickle.UnpicklingError, match="over the bound of"):
        deserialize_named_tensors(_pickle(storage), None)
    check_payload(base64.b64decode(_pickle(storage)), max_bytes=10**13)  # within its bound


def test_state_may_be_set_only_on_the_bucket_metadata() -> None:
    size = _call(_global("torch", "Size"), b"K\x02\x85")  # torch.Size((2,))
    payload = _pickle(size + b"}" + _str("x") + _str("y") + b"s" + b"b")  # BUILD on it
    with pytest.raises(pickle.UnpicklingError, match="refusing to set the state of an object"):
        deserialize_named_tensors(payload, None)


def test_truncated_counted_data_is_refused_before_anything_is_allocated() -> None:
    """BINBYTES8 claims 1 GB; the C unpickler would allocate it before reading."""
    payload = b"\x80\x04\x8e" + struct.pack("<Q", 10**9) + b"xx."
    with pytest.raises(pickle.UnpicklingError, match="malformed weight payload"):
        deserialize_named_tensors(base64.b64encode(payload).decode(), None)


def _roundtrip(named: list[tuple[str, torch.Tensor]], payload: str) -> None:
    back = deserialize_named_tensors(payload, "flattened_bucket")
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, want), (_, got) in zip(named, back, strict=True):
        assert torch.equal(want, got)


def test_agentrl_senders_cpu_bucket_loads() -> None:
    named = [("w", torch.randn(3, 4)), ("b", torch.randn(4))]
    bucket = flatten_bucket(named)  # kept alive: its shared memory backs the payload
    _roundtrip(named, serialize_for_ipc(bucket))


@pytest.fixture
def sglang_metadata_class(monkeypatch: pytest.MonkeyPatch) -> type:
    """A dataclass named as SGLang's `FlattenedTensorMetadata` (pickled by NEWOBJ + BUILD)."""
    name = "sglang.srt.weight_sync.tensor_bucket"
    module = types.ModuleType(name)

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = name
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    module.FlattenedTensorMetadata = FlattenedTensorMetadata  # type: ignore[attr-defined]
    for parent in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, name, module)
    return FlattenedTensorMetadata


@pytest.mark.parametrize("strategy", ["file_system", "file_descriptor"])
def test_sglang_style_bucket_loads(sglang_metadata_class: type, strategy: str) -> None:
    """SGLang's serializer: a ForkingPickler dump of {flattened_tensor, metadata} with its
    dataclass metadata, CPU storage shared by file name or by fd."""
    named = [("w", torch.randn(2, 3)), ("b", torch.randn(5))]
    bucket = flatten_bucket(named)
    bucket["metadata"] = [sglang_metadata_class(**vars(m)) for m in bucket["metadata"]]
    old = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(strategy)
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(bucket)
    finally:
        torch.multiprocessing.set_sharing_strategy(old)
    assert b"FlattenedTensorMetadata" in buf.getvalue()
    _roundtrip(named, base64.b64encode(buf.getvalue()).decode())
