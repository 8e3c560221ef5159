"""How a trainer worker's weight buckets reach the engines: one `WeightSender` per transport
(tensor: same host, CUDA IPC / shared memory or the tensors themselves to an in-process engine;
distributed: a broadcast group with every engine rank; disk: a checkpoint directory), each
opening the engines' weight-update session, sending buckets, and closing it (cache flushed)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal, Protocol

Transport = Literal["tensor", "distributed", "disk"]
Bucket = list[tuple[str, Any]]  # (HF name, tensor)


class WeightSender(Protocol):
    async def begin(self) -> None:
        """Open the engines' weight-update session (SGLang 0.5.23 takes updates inside one)."""
        ...

    async def send(self, bucket: Bucket, version: str | None) -> None:
        """One bucket; `version` comes with the last bucket and takes effect with it."""
        ...

    async def end(self, version: str) -> None:
        """Close the session; the engines flush their prefix cache and serve `version`."""
        ...

    async def close(self) -> None: ...


async def _each(targets: list[Any], method: str, *args: Any, **kwargs: Any) -> None:
    await asyncio.gather(*(getattr(t, method)(*args, **kwargs) for t in targets))


def _with_sessions(targets: list[Any]) -> list[Any]:
    """The targets that take updates in a session (SGLang clients; an in-process engine has none)."""
    return [t for t in targets if hasattr(t, "begin_weight_update")]


class TensorSender:
    """Buckets as tensors: flattened per dtype over CUDA IPC (GPU) or shared memory (CPU) to a
    server on this host, or handed to an in-process engine."""

    def __init__(self, targets: list[Any]) -> None:
        self.targets = targets

    async def begin(self) -> None:
        await _each(_with_sessions(self.targets), "begin_weight_update")

    async def send(self, bucket: Bucket, version: str | None) -> None:
        await asyncio.gather(
            *(t.update_weights(bucket, weight_version=version or t.weight_version)
              for t in self.targets)
        )  # fmt: skip

    async def end(self, version: str) -> None:
        await _each(_with_sessions(self.targets), "end_weight_update")

    async def close(self) -> None:
        return None


_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja")  # fmt: skip


class DiskSender:
    """A safetensors checkpoint directory each server loads with `update_weights_from_disk`
    (written by the sender rank, the model's config files beside it: SGLang loads a whole dir)."""

    def __init__(self, targets: list[Any], model_path: str) -> None:
        self.targets, self.model_path = targets, model_path
        self._dir: Path | None = None
        self._num_files = 0

    async def begin(self) -> None:
        self._dir, self._num_files = Path(tempfile.mkdtemp(prefix="agentrl-weights-")), 0

    async def send(self, bucket: Bucket, version: str | None) -> None:
        from safetensors.torch import save_file

        assert self._dir is not None, "DiskSender.send before begin()"
        tensors = {n: t.detach().cpu().contiguous() for n, t in bucket}
        path = self._dir / f"model-{self._num_files:05d}.safetensors"
        await asyncio.to_thread(save_file, tensors, str(path))
        self._num_files += 1

    async def end(self, version: str) -> None:
        assert self._dir is not None, "DiskSender.end before begin()"
        try:
            for name in _MODEL_FILES:
                if (Path(self.model_path) / name).is_file():
                    shutil.copyfile(Path(self.model_path) / name, self._dir / name)
            path = str(self._dir)
            await _each(self.targets, "update_weights_from_disk", path, weight_version=version)
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    async def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


async def make_sender(
    transport: Transport, targets: list[Any], *, model_path: str, master_address: str
) -> WeightSender:
    """The sender for `transport` to `targets`, connected (none: a sender that sends nothing)."""
    if not targets:
        return TensorSender([])
    if transport == "disk":
        return DiskSender(targets, model_path)
    if transport == "distributed":
        # Rank 0 of one torch.distributed group with every engine rank (NCCL on GPU, gloo on
        # CPU): each bucket is broadcast while each server is told what to receive; across hosts.
        from agentrl.engine.sglang.weight_sender import DistributedWeightSender

        sender = DistributedWeightSender(targets, master_address=master_address)
        await sender.connect()
        return sender
    return TensorSender(targets)
