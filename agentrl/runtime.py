"""Where the trainer and the engines run, behind one narrow interface the loop drives:
`InProcessRuntime` (the laptop default: one process, one device) or `cluster.RayRuntime`
(trainer ranks and engine servers as Ray actors, colocated or disaggregated)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agentrl.config import RunConfig

if TYPE_CHECKING:
    from agentrl.engine.base import Engine
    from agentrl.trainer.batch import TrainBatch


class Runtime(Protocol):
    """What the loop needs of trainer and engines, wherever they live."""

    engine: Engine  # what episodes generate with
    dp_size: int  # trainer ranks: one TrainBatch each

    @property
    def pad_id(self) -> int: ...

    async def heal_engines(self) -> int:
        """Restart dead engine servers and bring them to the policy's weights; returns how many."""
        ...

    async def train_step(self, batches: list[TrainBatch]) -> dict[str, float]: ...

    async def sync_weights(self, version: str) -> dict[str, float]:
        """Push the trainer's weights to every engine, stamped `version`; returns timings."""
        ...

    async def policy_logprobs(self, token_ids: list[int], start: int) -> list[float]:
        """The trainer's logprobs of `token_ids[start:]` under its current weights."""
        ...

    async def save(self, directory: Path) -> None: ...

    async def load(self, directory: Path) -> None: ...

    async def close(self) -> None: ...


def uses_ray(cfg: RunConfig) -> bool:
    c = cfg.cluster
    if c.use_ray is not None:
        return c.use_ray
    return bool(
        c.ray_address
        or os.environ.get("RAY_ADDRESS")
        or c.colocate
        or c.rollout_num_gpus is not None
        or c.actor_num_nodes * c.actor_num_gpus_per_node > 1
    )


def _return_free_heap() -> None:
    """Give glibc's freed heap pages back to the OS. A CPU train step frees gigabytes of
    activations of a different shape every step; glibc kept them, and a 6-step search_r1 run
    grew from 5.4 to 11.9 GB peak RSS."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return
    libc.malloc_trim(0)


async def make_runtime(cfg: RunConfig, model_path: str, num_optimizer_steps: int) -> Runtime:
    if uses_ray(cfg):
        from agentrl.cluster import RayRuntime

        return await RayRuntime.start(cfg, model_path, num_optimizer_steps)
    from agentrl.engine.factory import make_engine
    from agentrl.trainer.backend import make_trainer_backend

    backend = make_trainer_backend(
        model_path,
        cfg.train,
        cfg.algo,
        device=cfg.model.device,
        dtype=cfg.model.dtype,
        temperature=cfg.rollout.rollout_temperature,
        num_optimizer_steps=num_optimizer_steps,
    )
    # On a GPU the trainer loads first and the engine's KV cache leaves room for the optimizer
    # state the trainer creates at its first step (engine and trainer share the device), unless
    # that state waits in host memory between steps (--offload-train).
    is_shared = _shares_device(cfg, backend)
    reserve = backend.pending_state_bytes() if is_shared else 0  # (loads the trainer first)
    if cfg.cluster.offload_train:
        reserve = 0
    return InProcessRuntime(cfg, backend, make_engine(cfg, reserve_bytes=reserve))


def _shares_device(cfg: RunConfig, backend: Any) -> bool:
    """An in-process engine on the trainer's GPU: they take turns with its memory."""
    return cfg.engine.kind == "local" and backend.device.type == "cuda"


class InProcessRuntime:
    """Trainer and engine in this process. On CUDA the engine gives its memory back while the
    trainer steps (weights first on resume, as colocated SGLang does); on CPU there is nothing
    to give back, so nothing moves, and the trainer steps on a worker thread while episodes go
    on (`--async`). A weight update closes the engine's gate: turns being generated finish on
    the old weights, the next ones wait for the new (no episode is aborted)."""

    dp_size = 1

    def __init__(self, cfg: RunConfig, backend: Any, engine: Engine) -> None:
        from agentrl.rollout.gate import GatedEngine

        self.cfg, self.backend = cfg, backend
        self.engine: Any = GatedEngine(engine)
        self._is_released = False
        self.is_state_offloaded = _shares_device(cfg, backend) and cfg.cluster.offload_train
        """The optimizer state goes to host memory after each step (--offload-train)."""

    @property
    def pad_id(self) -> int:
        return self.backend.pad_id

    async def heal_engines(self) -> int:
        return 0

    async def train_step(self, batches: list[TrainBatch]) -> dict[str, float]:
        (batch,) = batches
        if self.backend.device.type == "cuda":
            await self.engine.release_memory()
            self._is_released = True
        metrics = await asyncio.to_thread(self.backend.train_step, batch)
        if self.backend.device.type == "cpu":
            _return_free_heap()
        else:  # the step's gradients and cached blocks: the KV arena resumes into them
            await asyncio.to_thread(self.backend.free_step_memory)
        if self.is_state_offloaded:
            t0 = time.perf_counter()
            await asyncio.to_thread(self.backend.offload_state)
            metrics["time/offload_state_s"] = time.perf_counter() - t0
        return metrics

    async def policy_logprobs(self, token_ids: list[int], start: int) -> list[float]:
        return await asyncio.to_thread(self.backend.sequence_logprobs, token_ids, start)

    async def sync_weights(self, version: str) -> dict[str, float]:
        from agentrl.trainer.weights import serving_dtype
        from agentrl.weight_buckets import nbytes

        if self._is_released:
            await self.engine.resume_memory()
            self._is_released = False
        size = self.cfg.cluster.update_weight_buffer_size
        num_bytes = 0
        dtype = serving_dtype(self.cfg.model.dtype, self.backend.device.type == "cuda")
        t0 = time.perf_counter()
        # An SGLang server takes all the buckets in one weight-update session (flushed once).
        session = getattr(self.engine, "weight_update", None)
        async with self.engine.paused():  # running turns end on the old weights first
            t1 = time.perf_counter()
            async with session() if session is not None else contextlib.nullcontext():
                for bucket in self.backend.export_weights(size, dtype=dtype):
                    num_bytes += sum(nbytes(t) for _, t in bucket)
                    await self.engine.update_weights(bucket, weight_version=version)
        return {"weight_sync/bytes": float(num_bytes), "time/weight_sync_drain_s": t1 - t0}

    async def save(self, directory: Path) -> None:
        self.backend.save(directory)

    async def load(self, directory: Path) -> None:
        if self.is_state_offloaded:  # the loaded optimizer state lands on the GPU first
            await self.engine.release_memory()
            self._is_released = True  # the sync after a load resumes the engine
        self.backend.load(directory)
        if self.is_state_offloaded:
            self.backend.offload_state()

    async def close(self) -> None:
        await self.engine.close()
