"""The tensor transport: one weight-update session per sync around all the buckets (the flush
comes once, with its end), the version with the last bucket only, and an in-process engine
driven through `EngineTarget`."""

from __future__ import annotations

import torch

from agentrl.weights import make_sender
from agentrl.weights.tensor import EngineTarget, TensorSender


class RecordingTarget:
    """A server's weight part: records the session calls and each bucket's names and version."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def begin_weight_update(self) -> None:
        self.calls.append(("begin",))

    async def end_weight_update(self) -> None:
        self.calls.append(("end",))

    async def update_weights(self, named_tensors, *, weight_version):
        self.calls.append(("update", [n for n, _ in named_tensors], weight_version))

    async def update_weights_from_disk(self, model_path, *, weight_version):
        self.calls.append(("disk", model_path, weight_version))


class InProcessEngine:
    def __init__(self) -> None:
        self.weight_version = "0"
        self.versions: list[str] = []

    async def update_weights(self, named_tensors, *, weight_version: str) -> None:
        self.versions.append(weight_version)
        self.weight_version = weight_version


BUCKETS = [[("a", torch.ones(2))], [("b", torch.zeros(3))]]


async def test_one_session_spans_every_bucket_and_the_last_brings_the_version() -> None:
    targets = [RecordingTarget(), RecordingTarget()]
    sender = TensorSender(targets)
    await sender.begin()
    await sender.send(BUCKETS[0], None)
    await sender.send(BUCKETS[1], "v1")
    await sender.end("v1")
    for target in targets:
        assert target.calls == [
            ("begin",),
            ("update", ["a"], None),
            ("update", ["b"], "v1"),
            ("end",),  # one end: one flush per update
        ]
    assert set(sender.phases) == {"send_s", "end_s"}


async def test_an_in_process_engine_keeps_its_version_until_the_last_bucket() -> None:
    engine = InProcessEngine()
    sender = TensorSender([EngineTarget(engine)])
    await sender.begin()
    await sender.send(BUCKETS[0], None)
    await sender.send(BUCKETS[1], "v1")
    await sender.end("v1")
    assert engine.versions == ["0", "v1"]


async def test_no_targets_make_a_sender_that_sends_nothing() -> None:
    sender = await make_sender("distributed", [], model_path="unused", master_address="127.0.0.1")
    assert isinstance(sender, TensorSender) and sender.targets == []
    await sender.begin()
    await sender.send(BUCKETS[0], "v1")
    await sender.end("v1")
