"""`/update_weights_from_tensor` unpickles only an exact allow-list (SGLang 0.5.23's): payloads that
would run code (the 30-byte `("torch", "os.system")` pickle, dotted names reaching eval or
os.system, `builtins.getattr`, a reduce to `subprocess.Popen`) are a 400 naming the global, and
nothing runs; real payloads from agentrl's sender and from SGLang's serializer still load."""

from __future__ import annotations

import ast
import asyncio
import base64
import importlib
import importlib.util
import io
import sys
import types
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from agentrl.engine.local import LocalEngine
from agentrl.weights.receive import ALLOWED_GLOBALS
from agentrl.weights.wire import flatten_bucket, serialize_for_ipc

SGLANG_SRC = Path("/work/sglang-src/sglang-0.5.23")  # the unpacked wheel, where there is one
NAMES = ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]


@pytest.fixture(scope="module")
def served(served: tuple[str, LocalEngine]) -> tuple[str, LocalEngine]:
    """conftest's server, inside a weight-update session: SGLang 0.5.23 takes tensor updates
    only there (checked before unpickling)."""
    assert httpx.post(f"{served[0]}/begin_weight_update", json={}).status_code == 200
    return served


# ---------------------------------------------------------------- hand-assembled pickles


def _str(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def _global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + b"\x93"  # STACK_GLOBAL: what find_class is asked for


def _call(fn: bytes, *args: bytes) -> bytes:
    return fn + b"(" + b"".join(args) + b"tR"  # MARK args TUPLE REDUCE


def _pickle(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."  # protocol 4 ... STOP


def _attacks(canary: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (payload, the global the refusal must name); each creates `canary` if it runs."""
    touch = f"touch {canary}"
    return {
        "torch_os_system": (_pickle(_call(_global("torch", "os.system"), _str(touch))), "torch.os.system"),
        "dotted_eval": (
            _pickle(_call(_global("torch", "_jit_internal.builtins.eval"),
                          _str(f"open({str(canary)!r}, 'w')"))),
            "torch._jit_internal.builtins.eval",
        ),
        "dotted_nested_pickle": (
            _pickle(_call(_global("torch", "serialization.pickle.loads"),
                          b"C" + bytes([len(inner := _pickle(_call(_global("os", "system"), _str(touch))))]) + inner)),
            "torch.serialization.pickle.loads",
        ),
        "getattr": (
            _pickle(_call(_call(_global("builtins", "getattr"), _global("torch", "os"), _str("system")),
                          _str(touch))),
            "builtins.getattr",
        ),
        "popen": (
            _pickle(_call(_global("subprocess", "Popen"),
                          b"](" + _str("touch") + _str(str(canary)) + b"e")),  # fmt: skip
            "subprocess.Popen",
        ),
    }  # fmt: skip


@pytest.mark.parametrize(
    "attack", ["torch_os_system", "dotted_eval", "dotted_nested_pickle", "getattr", "popen"]
)
async def test_a_payload_that_would_run_code_is_a_400_and_nothing_runs(
    served, tmp_path: Path, attack: str
) -> None:
    url, _ = served
    canary = tmp_path / "canary"
    payload, refused = _attacks(canary)[attack]
    body = {"serialized_named_tensors": [base64.b64encode(payload).decode()],
            "load_format": "flattened_bucket"}  # fmt: skip
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post("/update_weights_from_tensor", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["success"] is False and f"refusing to unpickle {refused}" in r.json()["message"]
    await asyncio.sleep(0.2)  # a spawned process would have touched it by now
    assert not canary.exists()


def _post_payload(url: str, payload: str) -> httpx.Response:
    body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket",
            "weight_version": "4"}  # fmt: skip
    return httpx.post(f"{url}/update_weights_from_tensor", json=body, timeout=60)


def _perturbed(engine: LocalEngine, seed: int) -> list[tuple[str, torch.Tensor]]:
    state, gen = engine.model.state_dict(), torch.Generator().manual_seed(seed)
    return [(n, state[n].cpu() + torch.randn(state[n].shape, generator=gen)) for n in NAMES]


def _assert_loaded(engine: LocalEngine, named: list[tuple[str, torch.Tensor]]) -> None:
    state = engine.model.state_dict()
    for name, want in named:
        assert torch.equal(state[name].cpu(), want.to(state[name].dtype)), name


def test_agentrl_senders_payload_still_loads(served) -> None:
    url, engine = served
    named = _perturbed(engine, 1)
    bucket = flatten_bucket(named)  # kept alive: its shared memory backs the payload
    r = _post_payload(url, serialize_for_ipc(bucket))
    assert r.status_code == 200, r.text
    _assert_loaded(engine, named)


def test_simple_namespace_metadata_loads(served) -> None:
    url, engine = served
    named = _perturbed(engine, 2)
    bucket = flatten_bucket(named)
    bucket["metadata"] = [SimpleNamespace(**vars(m)) for m in bucket["metadata"]]
    r = _post_payload(url, serialize_for_ipc(bucket))
    assert r.status_code == 200, r.text
    _assert_loaded(engine, named)


@pytest.fixture
def sglang_tensor_bucket(monkeypatch: pytest.MonkeyPatch) -> Any:
    """SGLang's own `tensor_bucket` module, from an installed sglang, else from the unpacked
    wheel's file (it needs torch alone; `sglang/__init__` pulls in orjson, zmq, ...) under its
    real name, its parents empty stand-ins, so pickles name it as SGLang's do; removed after."""
    name = "sglang.srt.weight_sync.tensor_bucket"
    try:
        return importlib.import_module(name)
    except ImportError:
        pass
    path = SGLANG_SRC / "sglang/srt/weight_sync/tensor_bucket.py"
    if not path.is_file():
        pytest.skip(f"sglang is not installed and its source is not unpacked at {SGLANG_SRC}")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    for parent in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):  # empty packages
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_sglang_serializers_payload_still_loads(served, sglang_tensor_bucket) -> None:
    """SGLang's `FlattenedTensorBucket` (uint8 bytes, its metadata class) serialized as its
    `MultiprocessingSerializer.serialize(obj, output_str=True)` does: a ForkingPickler dump,
    base64 (mirrored here: its module needs orjson, zmq, ... to import)."""
    url, engine = served
    named = _perturbed(engine, 3)
    bucket = sglang_tensor_bucket.FlattenedTensorBucket(named_tensors=named)
    data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    buf = io.BytesIO()
    ForkingPickler(buf).dump(data)
    assert b"sglang.srt.weight_sync.tensor_bucket" in buf.getvalue()
    r = _post_payload(url, base64.b64encode(buf.getvalue()).decode())
    assert r.status_code == 200, r.text
    _assert_loaded(engine, named)


def test_the_allow_list_is_sglangs_torch_and_python_globals() -> None:
    """Every global SGLang 0.5.23's SafeUnpickler admits, less its own request classes (agentrl
    maps its metadata and CUDA rebuild to equivalents), and nothing else."""
    source = SGLANG_SRC / "sglang/srt/utils/common.py"
    if not source.is_file():
        pytest.skip(f"SGLang's source is not unpacked at {SGLANG_SRC}")
    tree = ast.parse(source.read_text())
    cls = next(
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "SafeUnpickler"
    )
    assign = next(s for s in cls.body if isinstance(s, ast.Assign))
    theirs = {
        p for p in ast.literal_eval(assign.value) if not p[0].startswith(("sglang", "torch_npu"))
    }
    assert theirs == ALLOWED_GLOBALS
    assert not any("." in name for _, name in ALLOWED_GLOBALS)
    assert ("builtins", "getattr") not in ALLOWED_GLOBALS
