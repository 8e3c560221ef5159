"""CUDA-IPC weight payloads through the receiver's allow-list, between two real processes (CUDA IPC
handles open only in another process): agentrl's sender (`serialize_for_ipc`, torch's device
ordinal) and SGLang's patched reduction (device UUID, rebuilt by
`sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified`, which the receiver maps to its own
equivalent) each arrive bit-exact; a UUID no GPU here has is refused.

Run as a script (`python tests/engine/serve/cuda_ipc_payloads.py`; needs torch with CUDA only:
agentrl's packages are loaded from their files, so the GPU machine needs no httpx or fastapi), or
through `test_serve_cuda_payloads.py`. Prints `OK` and exits 0 when every check holds."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
import tempfile
import types
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def _load_agentrl_files() -> None:
    """agentrl's engine packages as bare namespaces: only the modules imported are executed."""
    for name in ("agentrl", "agentrl.engine", "agentrl.engine.sglang"):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(ROOT / name.replace(".", "/"))]
            sys.modules[name] = module


def _sglang_stub() -> Any:
    """A module named as SGLang's patch, holding a function named as its rebuild: what its
    patched reduction pickles (the body is never run on the sending side)."""
    for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
        sys.modules.setdefault(name, types.ModuleType(name))
    stub = types.ModuleType("sglang.srt.utils.patch_torch")

    def _rebuild_cuda_tensor_modified(*args: Any) -> Any:
        raise AssertionError("the sender never rebuilds")

    _rebuild_cuda_tensor_modified.__module__ = stub.__name__
    _rebuild_cuda_tensor_modified.__qualname__ = "_rebuild_cuda_tensor_modified"
    stub._rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_modified  # type: ignore[attr-defined]
    sys.modules[stub.__name__] = stub
    return stub


def _sglang_style_payload(bucket: dict[str, Any], uuid: str | None = None) -> str:
    """SGLang's `monkey_patch_torch_reductions` + `MultiprocessingSerializer.serialize`: CUDA
    tensors carry their device's UUID (argument 6) instead of its ordinal."""
    import torch
    from torch.multiprocessing import reductions

    stub = _sglang_stub()

    def reduce_tensor(tensor: Any) -> Any:
        fn, args = reductions.reduce_tensor(tensor)
        if fn is reductions.rebuild_cuda_tensor:
            device_uuid = uuid or str(torch.cuda.get_device_properties(args[6]).uuid)
            fn, args = stub._rebuild_cuda_tensor_modified, (*args[:6], device_uuid, *args[7:])
        return fn, args

    class Pickler(ForkingPickler):
        _extra_reducers = {**ForkingPickler._extra_reducers, torch.Tensor: reduce_tensor}

    buf = io.BytesIO()
    Pickler(buf).dump(bucket)
    assert b"_rebuild_cuda_tensor_modified" in buf.getvalue()
    return base64.b64encode(buf.getvalue()).decode()


def receive(payload_file: str, out_file: str) -> None:
    """The receiving process: each payload line -> its tensors on the CPU, or the error."""
    import torch

    _load_agentrl_files()
    from agentrl.weights.receive import deserialize_named_tensors

    results: list[Any] = []
    for line in Path(payload_file).read_text().splitlines():
        try:
            named = deserialize_named_tensors(line, "flattened_bucket")
            results.append([(n, t.cpu().clone()) for n, t in named])
        except Exception as e:  # reported to the sender, which checks it
            results.append(f"{type(e).__name__}: {e}")
    torch.save(results, out_file)


def main() -> int:
    import torch

    _load_agentrl_files()
    from agentrl.weights.wire import flatten_bucket, serialize_for_ipc

    gen = torch.Generator().manual_seed(0)
    named = [("w", torch.randn(64, 32, generator=gen)), ("b", torch.randn(32, generator=gen))]
    bucket = flatten_bucket([(n, t.to("cuda", torch.bfloat16)) for n, t in named])
    payloads = [serialize_for_ipc(bucket), _sglang_style_payload(bucket),
                _sglang_style_payload(bucket, uuid="GPU-00000000-not-here")]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "payloads").write_text("\n".join(payloads))
        subprocess.run(
            [sys.executable, __file__, "--receive", f"{tmp}/payloads", f"{tmp}/out.pt"],
            check=True,
        )  # the bucket stays alive here until the receiver is done
        results = torch.load(f"{tmp}/out.pt", weights_only=False)
    want = [(n, t.to(torch.bfloat16)) for n, t in named]
    for label, got in zip(("agentrl", "sglang-uuid"), results[:2], strict=True):
        assert not isinstance(got, str), f"{label} payload refused: {got}"
        assert [n for n, _ in got] == ["w", "b"], label
        assert all(torch.equal(g, w) for (_, g), (_, w) in zip(got, want, strict=True)), label
    assert "no GPU here has device_uuid='GPU-00000000-not-here'" in results[2], results[2]
    print("OK")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--receive"]:
        receive(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
