"""Issue 26's GPU check: the CUDA-IPC payload agentrl's trainer builds for
`/update_weights_from_tensor` (`load_format="flattened_bucket"`, one serialization per TP rank, as
`SGLangWeightControl._push` sends it) is accepted by SGLang's own receiving code and rebuilt
bit-exact on CUDA tensors, in a second process, as SGLang's TP worker does it:
`monkey_patch_torch_reductions()`, `MultiprocessingSerializer.deserialize(payloads[tp_rank])`
(its SafeUnpickler), the weight updater's metadata conversion and
`FlattenedTensorBucket.reconstruct_tensors()`.

Two senders: one where sglang is importable in the trainer (SGLang's metadata class and its
device-UUID reduction) and one where it is not (`types.SimpleNamespace` metadata, torch's own
reduction with the device ordinal). Each TP rank's receiver opens only its own payload.

    AGENTRL_SGLANG_PATH=/path/to/sglang-install python tests/engine/sglang_real/cuda_ipc_sglang.py

Needs torch with CUDA and SGLang's files on AGENTRL_SGLANG_PATH; agentrl's engine modules are
loaded from their files (no httpx or fastapi needed). Prints `OK` and exits 0 when all holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
TP_SIZE = 2
DTYPES = ("bfloat16", "float32", "float16")


def _load_agentrl_files() -> None:
    """agentrl's engine packages as bare namespaces: only the modules imported are executed."""
    for name in ("agentrl", "agentrl.engine", "agentrl.engine.sglang"):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(ROOT / name.replace(".", "/"))]
            sys.modules[name] = module


def _named_tensors(dtype_name: str) -> list[tuple[str, Any]]:
    import torch

    gen = torch.Generator().manual_seed(len(dtype_name))
    dtype = getattr(torch, dtype_name)
    shapes = {"q_proj.weight": (96, 64), "norm.weight": (64,), "embed.weight": (17, 64, 3)}
    return [(n, torch.randn(s, generator=gen).to(dtype)) for n, s in shapes.items()]


def send(with_sglang: bool, work: str) -> None:
    """The trainer's side: flatten each dtype's tensors on CUDA and serialize once per TP rank."""
    import torch

    _load_agentrl_files()
    from agentrl.weights.sglang_compat import flattened_metadata_class
    from agentrl.weights.wire import flatten_bucket, serialize_for_ipc

    have = flattened_metadata_class() is not None
    assert have == with_sglang, f"sglang importable in the sender: {have}, wanted {with_sglang}"
    buckets, payloads, want = [], {}, {}
    for dtype_name in DTYPES:
        named = _named_tensors(dtype_name)
        bucket = flatten_bucket([(n, t.cuda()) for n, t in named])
        buckets.append(bucket)  # alive until every receiver is done
        payloads[dtype_name] = [serialize_for_ipc(bucket) for _ in range(TP_SIZE)]
        want[dtype_name] = named
    Path(work, "payloads.json").write_text(json.dumps(payloads))
    torch.save(want, Path(work, "want.pt"))
    env = {**os.environ, "PYTHONPATH": _sglang_path()}
    for rank in range(TP_SIZE):
        subprocess.run(
            [sys.executable, __file__, "--receive", work, str(rank)], check=True, env=env
        )
    torch.cuda.synchronize()


def receive(work: str, tp_rank: int) -> None:
    """SGLang's side, its own code: TpModelWorker.deserialize_own_rank + the weight updater."""
    import torch
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    payloads = json.loads(Path(work, "payloads.json").read_text())
    want = torch.load(Path(work, "want.pt"), weights_only=False)
    monkey_patch_torch_reductions()
    for dtype_name, per_rank in payloads.items():
        data = MultiprocessingSerializer.deserialize(per_rank[tp_rank])
        meta = [
            FlattenedTensorMetadata(
                name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                end_idx=m.end_idx, numel=m.numel,
            )
            for m in data["metadata"]
        ]  # fmt: skip
        bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=meta)
        got = bucket.reconstruct_tensors()
        assert [n for n, _ in got] == [n for n, _ in want[dtype_name]], dtype_name
        for (name, g), (_, w) in zip(got, want[dtype_name], strict=True):
            assert g.is_cuda, f"{dtype_name} {name}: rebuilt on {g.device}, not CUDA"
            assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape)
            assert torch.equal(g.cpu(), w), f"{dtype_name} {name}: values differ"


def _sglang_path() -> str:
    path = os.environ.get("AGENTRL_SGLANG_PATH", "")
    if not path:
        raise SystemExit("set AGENTRL_SGLANG_PATH to a directory holding SGLang's package")
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([path, *rest])


def main() -> int:
    without = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for with_sglang in (True, False):
        env = dict(os.environ)
        env["PYTHONPATH"] = _sglang_path() if with_sglang else os.pathsep.join(without)
        with tempfile.TemporaryDirectory() as work:
            subprocess.run(
                [sys.executable, __file__, "--send", str(int(with_sglang)), work],
                check=True, env=env,
            )  # fmt: skip
        print(f"sender {'with' if with_sglang else 'without'} sglang: {TP_SIZE} ranks x "
              f"{len(DTYPES)} buckets rebuilt bit-exact by SGLang's deserializer on CUDA")  # fmt: skip
    print("OK")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--send"]:
        send(sys.argv[2] == "1", sys.argv[3])
    elif sys.argv[1:2] == ["--receive"]:
        receive(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(main())
