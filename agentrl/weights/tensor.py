"""The tensor transport: each bucket handed to the engines as tensors -- to a server on this host
as SGLang's flattened bucket over CUDA IPC (GPU) or shared memory (CPU), or straight to an
in-process engine (`EngineTarget`)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from agentrl.weights.adapter import AdapterExport, adapter_name
from agentrl.weights.sender import Bucket, WeightTarget


class EngineTarget:
    """An in-process engine (`LocalEngine`) as a `WeightTarget`: it loads each bucket in place
    between its steps, so its session is empty and a bucket without a version keeps its own."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine  # an agentrl.engine.Engine

    async def begin_weight_update(self) -> None:
        return None

    async def end_weight_update(self) -> None:
        return None

    async def update_weights(self, named_tensors: Bucket, *, weight_version: int | None) -> None:
        version = self.engine.weight_version if weight_version is None else weight_version
        await self.engine.update_weights(named_tensors, weight_version=version)

    async def update_weights_from_disk(self, model_path: str, *, weight_version: int) -> None:
        raise ValueError("an in-process engine takes weights as tensors, not from disk")

    async def load_lora_adapter(
        self, name: str, adapter: AdapterExport, *, weight_version: int
    ) -> None:
        await self.engine.load_lora_adapter(name, adapter, weight_version=weight_version)

    async def unload_lora_adapter(self, name: str) -> None:
        await self.engine.unload_lora_adapter(name)


class TensorSender:
    def __init__(self, targets: Sequence[WeightTarget]) -> None:
        self.targets = list(targets)
        self.phases: dict[str, float] = defaultdict(float)
        self.served_adapter: str | None = None  # the LoRA adapter the engines serve, if any

    async def begin(self) -> None:
        self.phases = defaultdict(float)
        await asyncio.gather(*(t.begin_weight_update() for t in self.targets))

    async def send(self, bucket: Bucket, version: int | None) -> None:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(t.update_weights(bucket, weight_version=version) for t in self.targets)
        )
        self.phases["send_s"] += time.perf_counter() - t0

    async def end(self, version: int) -> None:
        t0 = time.perf_counter()
        await asyncio.gather(*(t.end_weight_update() for t in self.targets))
        self.phases["end_s"] = time.perf_counter() - t0

    async def send_adapter(self, adapter: AdapterExport, version: int) -> None:
        """LoRA: the adapter alone, loaded under `adapter_name(version)`, then the one it replaces
        unloaded (each engine serves the new one from its load on)."""
        t0 = time.perf_counter()
        name = adapter_name(version)
        load = (t.load_lora_adapter(name, adapter, weight_version=version) for t in self.targets)
        await asyncio.gather(*load)
        self.phases["send_s"] += time.perf_counter() - t0
        old = self.served_adapter
        if old is not None and old != name:
            await asyncio.gather(*(t.unload_lora_adapter(old) for t in self.targets))
        self.served_adapter = name
        self.phases["end_s"] = time.perf_counter() - t0 - self.phases["send_s"]

    async def close(self) -> None:
        return None
