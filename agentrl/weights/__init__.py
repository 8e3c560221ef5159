"""Weight transfer, trainer to engines: `export.py` (a model's whole HF-named tensors),
`buckets.py` (cut per dtype and size), `wire.py` (SGLang's flattened bucket and IPC payload),
`sender.py` (the `WeightSender` and `WeightTarget` protocols), one sender per
transport (`tensor.py`, `distributed.py`, `disk.py`) over `group.py`'s broadcast group, and the
engine's side (`receive.py`, after `payload.py`'s checks). Imports no engine client."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from agentrl.weights.sender import BroadcastTarget, Transport, WeightSender, WeightTarget


async def make_sender(
    transport: Transport,
    targets: Sequence[WeightTarget],
    *,
    model_path: str,
    master_address: str,
) -> WeightSender:
    """The sender for `transport` to `targets`, connected (none: a sender that sends nothing).
    The distributed transport reaches servers only (config_checks: no broadcast into an
    in-process engine), so its targets are `BroadcastTarget`s."""
    from agentrl.weights.disk import DiskSender
    from agentrl.weights.distributed import DistributedSender
    from agentrl.weights.tensor import TensorSender

    if not targets:
        return TensorSender([])
    if transport == "disk":
        return DiskSender(targets, model_path)
    if transport == "distributed":
        servers = cast("Sequence[BroadcastTarget]", targets)
        sender = DistributedSender(servers, master_address=master_address)
        await sender.connect()
        return sender
    return TensorSender(targets)
