"""How a trainer rank's weight buckets reach the engines: the `WeightSender` protocol (one sender
per transport: `tensor.py`, `distributed.py`, `disk.py`; `agentrl.weights.make_sender` picks and
connects one) and the engine side it talks to (`WeightTarget`, `BroadcastTarget`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from agentrl.weights.adapter import AdapterExport

Transport = Literal["tensor", "distributed", "disk"]
Bucket = list[tuple[str, Any]]  # (HF name, tensor)


class WeightTarget(Protocol):
    """One engine's weight updates, inside its weight-update session (SGLang 0.5.23 takes tensor
    and broadcast updates only inside one; an in-process engine's session is empty)."""

    async def begin_weight_update(self) -> None: ...

    async def end_weight_update(self) -> None:
        """Close the session; the engine flushes its prefix cache (once per update)."""
        ...

    async def update_weights(self, named_tensors: Bucket, *, weight_version: int | None) -> None:
        """One bucket as tensors (same host); `weight_version` None keeps the served version."""
        ...

    async def update_weights_from_disk(self, model_path: str, *, weight_version: int) -> None: ...

    async def load_lora_adapter(
        self, name: str, adapter: AdapterExport, *, weight_version: int
    ) -> None:
        """Load a LoRA adapter under `name` (SGLang's `/load_lora_adapter_from_tensors`); the
        engine serves `weight_version` from then on, with requests naming `name`."""
        ...

    async def unload_lora_adapter(self, name: str) -> None: ...


class BroadcastTarget(WeightTarget, Protocol):
    """A server whose ranks join a broadcast group (`/init_weights_update_group`) and receive
    each bucket from the trainer's rank 0 (`/update_weights_from_distributed`)."""

    @property
    def worker_urls(self) -> list[str]: ...

    async def tp_size(self, url: str | None = None) -> int: ...

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        url: str | None = None,
    ) -> None: ...

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: int | None = None,
        load_format: str | None = None,
        url: str | None = None,
    ) -> None: ...

    async def destroy_weights_update_group(
        self, group_name: str, *, url: str | None = None
    ) -> None: ...


class WeightSender(Protocol):
    """`phases` accumulates the seconds of each step of the sends since `begin` (flatten, send,
    end), for the run's timings."""

    phases: dict[str, float]

    async def begin(self) -> None:
        """Open the engines' weight-update session."""
        ...

    async def send(self, bucket: Bucket, version: int | None) -> None:
        """One bucket; `version` comes with the last bucket and takes effect with it."""
        ...

    async def end(self, version: int) -> None:
        """Close the session; the engines flush their prefix cache and serve `version`."""
        ...

    async def close(self) -> None: ...
