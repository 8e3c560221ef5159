"""agentrl's launcher, request bodies and weight payloads checked by SGLang's own code: ServerArgs
parses the launch command, io_struct's request classes validate every control body, SGLang's
SafeUnpickler and FlattenedTensorBucket rebuild the IPC payload (with and without sglang
importable in the trainer), and SGLang's receiver joins agentrl's broadcast over gloo.

Needs an SGLang installed by `bash scripts/install_sglang_cpu.sh VERSION DIR` and
AGENTRL_SGLANG_PATH=DIR; skips with that reason otherwise. Run these in a pytest process of their
own: DIR goes to the front of sys.path (its pinned transformers wins over the venv's)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

SGLANG_PATH = os.environ.get("AGENTRL_SGLANG_PATH")
pytestmark = pytest.mark.skipif(
    not SGLANG_PATH,
    reason="AGENTRL_SGLANG_PATH is unset: install SGLang for CPU with "
    "`bash scripts/install_sglang_cpu.sh 0.5.23 DIR` and point it at DIR",
)


def _source(fn: Any) -> str:
    import inspect

    return inspect.getsource(fn)


NAMED = [
    ("layers.0.w", torch.randn(3, 5)),
    ("layers.0.b", torch.randn(5)),
    ("emb", torch.randn(7, 2)),
]


@pytest.fixture(scope="module")
def sglang() -> ModuleType:
    assert SGLANG_PATH
    if SGLANG_PATH not in sys.path:
        sys.path.insert(0, SGLANG_PATH)
    import sglang

    from agentrl.weights import sglang_compat as compat

    compat.flattened_metadata_class.cache_clear()  # sglang is importable from here on
    return sglang


@pytest.fixture
def server() -> Iterator[Any]:
    from tests.engine.sglang_client.standin import StandIn

    standin = StandIn(tp_size=2).start()
    yield standin
    standin.stop()


def test_server_args_parse_the_launch_commands(sglang: ModuleType) -> None:
    from sglang.srt.server_args import ServerArgs

    from agentrl.config import EngineConfig
    from agentrl.deploy.processes import KEYED_LAUNCHER, server_command
    from agentrl.deploy.servers import ServerSpec, server_cmd

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    engine = EngineConfig(mem_fraction_static=0.7, sglang_args=["--context-length", "512"])
    cmd = server_command("/m", engine, host="127.0.0.1", port=30001, tp_size=2, base_gpu_id=2,
                         enable_memory_saver=True, api_key="k")  # fmt: skip
    # keyed: `python -m KEYED_LAUNCHER sglang.launch_server ARGS`, which appends `--api-key` from
    # the environment inside the process (test_launcher.py shows it reaching SGLang's argv)
    assert cmd[1:4] == ["-m", KEYED_LAUNCHER, "sglang.launch_server"] and "k" not in cmd
    args = parser.parse_args([*cmd[4:], "--api-key", "k"])
    assert (args.model_path, args.port, args.tp_size, args.base_gpu_id) == ("/m", 30001, 2, 2)
    assert args.mem_fraction_static == 0.7 and args.context_length == 512
    assert args.enable_memory_saver is True and args.api_key == "k"

    def spec(is_colocated: bool) -> ServerSpec:
        return ServerSpec(index=0, model_path="/m", device_ids=[1], use_gpu=True, use_sglang=True,
                          host="127.0.0.1", dtype="bfloat16", engine=EngineConfig(),
                          log_dir=".", health_timeout_s=1, is_colocated=is_colocated)  # fmt: skip

    # Colocated, release/resume must free memory: SGLang does so only with its memory saver.
    colocated = parser.parse_args(server_cmd(spec(True), 30002)[3:])
    assert colocated.enable_memory_saver is True and colocated.base_gpu_id == 1
    assert parser.parse_args(server_cmd(spec(False), 30002)[3:]).enable_memory_saver is False


async def test_every_body_the_client_sends_validates_as_sglangs_request(
    sglang: ModuleType, server: Any
) -> None:
    from pydantic import TypeAdapter
    from sglang.srt.managers import io_struct

    from agentrl.engine.sglang import SGLangEngine

    engine = SGLangEngine(server.url, retry_backoff_s=0.01)
    await engine.release_memory()
    await engine.resume_memory()
    await engine.pause_generation("retract")
    await engine.update_weights(NAMED, weight_version=1)
    await engine.update_weights([], weight_version=2)
    async with engine.weights.weight_update():
        await engine.weights.update_weights_from_distributed(
            names=["w"], dtypes=["float32"], shapes=[[2, 2]], load_format="flattened_bucket"
        )
    await engine.weights.update_weights_from_disk("/ckpt", weight_version=3)
    await engine.continue_generation()
    await engine.abort(poll_interval_s=0.01)
    await engine.close()
    classes = {
        "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
        "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
        "/pause_generation": "PauseGenerationReqInput",
        "/continue_generation": "ContinueGenerationReqInput",
        "/begin_weight_update": "BeginWeightUpdateReqInput",
        "/end_weight_update": "EndWeightUpdateReqInput",
        "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
        "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
        "/update_weight_version": "UpdateWeightVersionReqInput",
        "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
        "/abort_request": "AbortReq",
    }
    parsed: dict[str, list[Any]] = {}
    for path, body, _ in server.requests:
        name = classes.get(path)
        if name is not None and hasattr(io_struct, name):  # 0.5.15 has no session classes
            parsed.setdefault(path, []).append(
                TypeAdapter(getattr(io_struct, name)).validate_python(body)
            )
    assert set(parsed) >= set(classes) - {"/begin_weight_update", "/end_weight_update"}
    (version,) = parsed["/update_weight_version"]
    assert version.new_version == "2" and version.abort_all_requests is False
    for update in parsed["/update_weights_from_tensor"]:
        assert len(update.serialized_named_tensors) == 2  # one per TP rank, decoded from base64
        assert update.flush_cache is False and update.abort_all_requests is False
    (dist,) = parsed["/update_weights_from_distributed"]
    assert dist.flush_cache is False and dist.abort_all_requests is False
    assert parsed["/pause_generation"][0].mode == "retract"
    assert server.paths()[-1] != "/update_weights_from_disk"  # a flush followed every update


@pytest.mark.parametrize("is_sglang_in_trainer", [False, True])
def test_the_ipc_payload_passes_sglangs_unpickler_and_rebuilds_bit_exact(
    sglang: ModuleType, is_sglang_in_trainer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without sglang in the trainer, agentrl's own metadata class was refused ("Blocked unsafe
    global"); with it, SGLang's CUDA-IPC patch ran on CPU tensors (IndexError)."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    from agentrl.weights import sglang_compat as compat
    from agentrl.weights.wire import flatten_bucket, serialize_for_ipc

    if not is_sglang_in_trainer:
        monkeypatch.setattr(compat, "flattened_metadata_class", lambda: None)
    payload = serialize_for_ipc(flatten_bucket(NAMED))
    obj = MultiprocessingSerializer.deserialize(payload)  # SafeUnpickler
    # as SGLang's model runner rebuilds a flattened bucket (_update_weights_from_flattened_bucket)
    meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype,
                                    start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel)
            for m in obj["metadata"]]  # fmt: skip
    bucket = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=meta)
    rebuilt = bucket.reconstruct_tensors()
    assert [n for n, _ in rebuilt] == [n for n, _ in NAMED]
    for (_, want), (_, got) in zip(NAMED, rebuilt, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_broadcast_bucket_is_what_sglangs_receiver_posts(sglang: ModuleType) -> None:
    """NCCL needs the same element count and type on every rank: SGLang receives a flattened
    bucket as uint8 bytes (FlattenedTensorBucket.empty); agentrl sent it in the weights' dtype."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from agentrl.weights.wire import flatten_into

    tensors = [t.to(torch.bfloat16) for _, t in NAMED]
    sent = flatten_into(tensors)
    names, shapes = [n for n, _ in NAMED], [list(t.shape) for t in tensors]
    posted = _receive_bucket(FlattenedTensorBucket, names, ["bfloat16"] * 3, shapes)
    posted = posted.get_flattened_tensor()
    assert (sent.dtype, sent.numel()) == (posted.dtype, posted.numel())


def _receive_bucket(cls: Any, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> Any:
    """The bucket SGLang's model runner posts for a flattened broadcast: `empty` (0.5.23), or a
    bucket of empty tensors (0.5.15, `_update_bucketed_weights_from_distributed`)."""
    if hasattr(cls, "empty"):
        return cls.empty(names, dtypes, shapes, "cpu")
    named = [
        (n, torch.empty(s, dtype=getattr(torch, d)))
        for n, d, s in zip(names, dtypes, shapes, strict=True)
    ]
    return cls(named_tensors=named)


_RECEIVER = f"""
import json, sys, torch
from typing import Any
from sglang.srt.utils.common import init_custom_process_group
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
{_source(_receive_bucket)}
port, names, dtypes, shapes, out = json.loads(sys.argv[1])
pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{{port}}",
                               world_size=2, rank=1, group_name="weight_update_group")
bucket = _receive_bucket(FlattenedTensorBucket, names, dtypes, shapes)
torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
torch.save(dict(bucket.reconstruct_tensors()), out)
# Leave without tearing the group down at interpreter exit: gloo's threads, still paired with
# the sender, were seen to end the process with std::terminate (SIGABRT) after a good receive.
import os; os._exit(0)
"""


class _Member:
    """The engine side's HTTP calls, as a test double: the receiver joins by itself."""

    worker_urls = ["http://engine"]

    async def tp_size(self, url: str | None = None) -> int:
        return 1

    async def init_weights_update_group(self, **kw: Any) -> None: ...

    async def update_weights_from_distributed(self, **kw: Any) -> None: ...

    async def destroy_weights_update_group(self, *a: Any, **kw: Any) -> None: ...


async def test_sglangs_receiver_joins_our_broadcast_over_gloo(
    sglang: ModuleType, tmp_path: Path
) -> None:
    from agentrl.deploy.processes import free_ports
    from agentrl.weights.distributed import DistributedSender

    (port,) = free_ports(1)
    out = tmp_path / "received.pt"
    spec = [
        port,
        [n for n, _ in NAMED],
        ["float32"] * 3,
        [list(t.shape) for _, t in NAMED],
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SGLANG_PATH), os.getcwd()])}
    receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER, json.dumps(spec)], env=env)
    sender = DistributedSender([_Member()], master_port=port, backend="gloo")  # type: ignore[list-item]
    try:
        await sender.connect()
        await sender.send(NAMED, "1")
        assert receiver.wait(timeout=300) == 0
    finally:
        await sender.close()
        if receiver.poll() is None:
            receiver.kill()
    received = torch.load(out)
    for name, want in NAMED:
        assert torch.equal(received[name], want)
