"""`TrainerWorker.send_weights`: one session per sync, the version with the last bucket, and each
bucket in flight while the next one is exported (the sender of bucket 0 waits for bucket 2's
export: a send that blocked the export would never see it, and the sync would fail)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import torch

from agentrl.deploy.trainer_worker import TrainerWorker


class ExportingBackend:
    """Three one-tensor buckets; records when each has been exported."""

    def __init__(self) -> None:
        self.exported = [threading.Event() for _ in range(3)]

    def export_weights(self, bucket_bytes: int, *, dtype: object):
        for i, event in enumerate(self.exported):
            event.set()
            yield [(f"w{i}", torch.full((2,), float(i)))]


class WaitingSender:
    """Holds bucket 0's send until bucket 2 has been exported."""

    def __init__(self, backend: ExportingBackend) -> None:
        self.backend = backend
        self.calls: list[tuple] = []
        self.phases: dict[str, float] = {"send_s": 0.0}

    async def begin(self) -> None:
        self.calls.append(("begin",))

    async def send(self, bucket, version) -> None:
        if bucket[0][0] == "w0":
            overlapped = await asyncio.to_thread(self.backend.exported[2].wait, 30)
            assert overlapped, "bucket 2 was not exported while bucket 0 was being sent"
        self.calls.append(("send", bucket[0][0], version))

    async def end(self, version: str) -> None:
        self.calls.append(("end", version))

    async def close(self) -> None:
        return None


def _worker(backend: ExportingBackend, loop: asyncio.AbstractEventLoop) -> TrainerWorker:
    """A worker around `backend` (no model: the export and the sends are what is tested)."""
    worker = TrainerWorker.__new__(TrainerWorker)
    train = SimpleNamespace(lora_rank=0)  # full fine-tuning: the buckets go
    worker.spec = SimpleNamespace(bucket_bytes=1 << 20, shares_gpu=False, train=train)  # type: ignore[assignment]
    worker.backend = backend  # type: ignore[assignment]
    worker.is_cuda = False
    worker._dtype = torch.float32
    worker._loop = loop
    return worker


def test_each_bucket_is_sent_while_the_next_is_exported() -> None:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    backend = ExportingBackend()
    worker = _worker(backend, loop)
    worker._sender = sender = WaitingSender(backend)
    try:
        sent = worker.send_weights("v1")
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert sender.calls == [
        ("begin",),
        ("send", "w0", None),
        ("send", "w1", None),
        ("send", "w2", "v1"),
        ("end", "v1"),
    ]
    assert sent["bytes"] == 3 * 2 * 4
    assert "sender_send_s" in sent and sent["send_s"] >= 0.0


def test_a_lora_run_refuses_a_transport_other_than_tensors_in_one_line() -> None:
    import pytest

    from agentrl.weights.tensor import TensorSender

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    worker = _worker(ExportingBackend(), loop)
    worker.spec = SimpleNamespace(train=SimpleNamespace(lora_rank=16), api_key=None)  # type: ignore[assignment]
    worker._sender = TensorSender([])
    try:
        for transport in ("distributed", "disk"):
            with pytest.raises(
                ValueError, match=f"update_weight_transport={transport}: a LoRA run"
            ):
                worker.connect_engines([object()], transport)  # type: ignore[arg-type]
        worker.connect_engines([object()], "tensor")
        assert isinstance(worker._sender, TensorSender) and len(worker._sender.targets) == 1
    finally:
        loop.call_soon_threadsafe(loop.stop)
