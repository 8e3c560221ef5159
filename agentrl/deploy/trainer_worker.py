"""`TrainerWorker`: one trainer rank -- its backend (`train.backend`), its memory between steps,
the export of its weights and their sending to the engines. In process: one worker called on
worker threads; on Ray: one per rank in an actor, inside one torch.distributed group (NCCL on
GPU, gloo on CPU). `TrainerGroup` drives the workers together."""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from agentrl.weights import make_sender
from agentrl.weights.buckets import nbytes
from agentrl.weights.sender import Transport, WeightSender, WeightTarget
from agentrl.weights.tensor import EngineTarget, TensorSender

if TYPE_CHECKING:
    from agentrl.config import AlgoConfig, TrainConfig


@dataclass
class WorkerSpec:
    """What one worker builds its backend from (its own config sections, not the run's)."""

    model_path: str
    train: TrainConfig
    algo: AlgoConfig
    dtype: str
    device: str  # "auto", "cpu", "cuda:N"
    temperature: float
    num_optimizer_steps: int
    bucket_bytes: int  # cluster.update_weight_buffer_size
    shares_gpu: bool = False  # an engine resumes into this GPU after each step
    offload_train: bool = False  # the optimizer state waits in host memory between steps
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: no process group (one worker in this process)
    device_id: int = 0  # LOCAL_RANK: the GPU id on its node (a CPU rank: its bundle's index)
    api_key: str | None = None  # the engines' --api-key (read on the driver)


def _return_free_heap() -> None:
    """Give glibc's freed heap pages back to the OS. A CPU train step frees gigabytes of
    activations of a different shape every step; glibc kept them, and a 6-step search_r1 run
    grew from 5.4 to 11.9 GB peak RSS."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return
    libc.malloc_trim(0)


class TrainerWorker:
    """One trainer rank. Every collective method is called on all workers at once."""

    def __init__(self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """`loop`: where the sends run (the driver's, in process); None = a loop of its own
        (an actor: Ray may already run a loop on the calling thread)."""
        from agentrl.model_store import resolve_dtype
        from agentrl.trainer.backend import make_trainer_backend

        self.spec = spec
        device = _join_group(spec) if spec.master_port else spec.device
        self.backend = make_trainer_backend(
            spec.model_path,
            spec.train,
            spec.algo,
            device=device,
            dtype=spec.dtype,
            temperature=spec.temperature,
            num_optimizer_steps=spec.num_optimizer_steps,
        )
        self.is_cuda = self.backend.device.type == "cuda"
        self.is_state_offloaded = spec.shares_gpu and self.is_cuda and spec.offload_train
        """Between steps the optimizer state waits in host memory (--offload-train)."""
        # weight sync sends the engines' dtype: a bf16 engine never receives fp32 master weights
        self._dtype = resolve_dtype(spec.dtype, self.backend.device.type)
        if loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="weight-sync", daemon=True).start()
        self._loop = loop
        self._sender: WeightSender = TensorSender([])  # no engines yet

    # -- training

    def pad_id(self) -> int:
        return self.backend.pad_id

    def data_parallel_rank(self) -> int:
        """Which of `build_train_batches(..., dp_size)`'s batches this rank trains on: its own
        rank under FSDP; under Megatron its replica's (the TP and PP ranks of a replica share the
        batch). Collective under Megatron the first time (it builds the model and its groups)."""
        if self.spec.train.backend == "megatron":
            return self.backend.dp_rank  # type: ignore[attr-defined]
        return self.spec.rank

    def engine_reserve_bytes(self) -> int:
        """What an engine sharing this GPU leaves out of its KV cache: the optimizer state this
        rank creates at its first step (none when it waits in host memory between steps)."""
        if not (self.spec.shares_gpu and self.is_cuda) or self.is_state_offloaded:
            return 0
        return self.backend.pending_state_bytes()

    def train_step(self, batch: Any) -> dict[str, float]:
        metrics = self.backend.train_step(batch)
        if not self.is_cuda:
            _return_free_heap()
        elif self.spec.shares_gpu:  # the engine's KV cache resumes into what the step used
            self.backend.free_step_memory()
        if self.is_state_offloaded:
            t0 = time.perf_counter()
            self.backend.offload_state()
            metrics["time/offload_state_s"] = time.perf_counter() - t0
        return metrics

    def sequence_logprobs(
        self, token_ids: list[int], start: int, masks: tuple[list[int], list[float]] | None = None
    ) -> list[float]:
        return self.backend.sequence_logprobs(token_ids, start, masks)

    def save(self, directory: str) -> None:
        self.backend.save(directory)

    def load(self, directory: str) -> None:
        self.backend.load(directory)
        if self.is_state_offloaded:  # the loaded state landed on the GPU first
            self.backend.offload_state()

    # -- weights

    def connect_engines(self, targets: list[Any], transport: Transport) -> None:
        """Send to `targets` from now on: engines (in process) or server URLs (a client each)."""
        self.close_engines()
        weight_targets = [_weight_target(t, self.spec.api_key) for t in targets]
        if self.spec.train.lora_rank:  # the adapter goes as tensors, whatever the transport
            if weight_targets and transport != "tensor":
                raise ValueError(
                    f"update_weight_transport={transport}: a LoRA run (train.lora_rank="
                    f"{self.spec.train.lora_rank}) sends its adapter as tensors; set "
                    "cluster.update_weight_transport=tensor"
                )
            self._sender = TensorSender(weight_targets)
            return
        connect = make_sender(
            transport,
            weight_targets,
            model_path=self.spec.model_path,
            master_address=self.spec.master_addr,
        )
        self._sender = self._run(connect)

    def send_weights(self, version: int) -> dict[str, float]:
        """Every rank iterates the export (it gathers the shards); a rank with engines sends
        them its buckets in one weight-update session. What waits on the engines overlaps this
        rank's own work: the session opens while the first buckets are exported, each bucket is
        in flight while the next is exported (one bucket more alive at once), and the session
        closes while the buckets' blocks go back. Returns the bytes exported, the wall time split
        into exporting and waiting on the sender (`send_s`), and the sender's own phases."""
        if self.spec.train.lora_rank:
            return self._send_adapter(version)
        t0 = time.perf_counter()
        num_bytes = 0
        wait_s = 0.0
        sending = asyncio.run_coroutine_threadsafe(self._sender.begin(), self._loop)
        buckets = self.backend.export_weights(self.spec.bucket_bytes, dtype=self._dtype)
        bucket = next(buckets, None)
        while bucket is not None:  # one ahead: the weight version goes with the last bucket
            following = next(buckets, None)  # exported while the bucket before it is sent
            num_bytes += sum(nbytes(t) for _, t in bucket)
            wait_s += _wait(sending)
            send = self._sender.send(bucket, version if following is None else None)
            sending = asyncio.run_coroutine_threadsafe(send, self._loop)
            bucket = following
        wait_s += _wait(sending)
        ending = asyncio.run_coroutine_threadsafe(self._sender.end(version), self._loop)
        if self.spec.shares_gpu and self.is_cuda:  # the buckets' blocks: the KV cache resumes next
            self.backend.free_step_memory()
        wait_s += _wait(ending)
        total_s = time.perf_counter() - t0
        phases = {f"sender_{k}": v for k, v in self._sender.phases.items()}
        return {"bytes": float(num_bytes), "export_s": total_s - wait_s, "send_s": wait_s, **phases}

    def _send_adapter(self, version: int) -> dict[str, float]:
        """LoRA: every rank gathers the adapter (collective); a rank with engines loads it into
        them under `adapter_name(version)` and unloads the one before (`TensorSender`)."""
        t0 = time.perf_counter()
        adapter = self.backend.export_adapter(dtype=self._dtype)
        t1 = time.perf_counter()
        sender = self._sender
        if isinstance(sender, TensorSender) and sender.targets:
            sender.phases = defaultdict(float)
            self._run(sender.send_adapter(adapter, version))
        phases = {f"sender_{k}": v for k, v in self._sender.phases.items()}
        send_s = time.perf_counter() - t1
        num_bytes = float(adapter.num_bytes)
        return {
            "bytes": num_bytes,
            "adapter_bytes": num_bytes,
            "export_s": t1 - t0,
            "send_s": send_s,
            **phases,
        }

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close_engines(self) -> None:
        self._run(self._sender.close())
        self._sender = TensorSender([])  # no engines: nothing sent

    def shutdown(self) -> None:
        import torch.distributed as dist

        self.close_engines()
        if self.spec.master_port and dist.is_initialized():
            dist.barrier()


def _wait(sending: Future[None]) -> float:
    """Seconds this thread waited for a call to the engines to finish (its error raised here)."""
    t0 = time.perf_counter()
    sending.result()
    return time.perf_counter() - t0


def _weight_target(target: Any, api_key: str | None) -> WeightTarget:
    """What a sender drives for one connect target: a server URL gets a client of its own, an
    SGLang client its weights part, an in-process engine loads buckets itself."""
    from agentrl.engine.sglang import SGLangEngine

    if isinstance(target, str):
        target = SGLangEngine(target, request_timeout_s=600.0, api_key=api_key)
    if isinstance(target, SGLangEngine):
        return target.weights
    return EngineTarget(target)


def _join_group(spec: WorkerSpec) -> str:
    """Join the trainer's process group as `spec.rank`; returns this rank's device."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.device_id),
    )
    is_gpu = spec.device.startswith("cuda")
    if is_gpu:
        torch.cuda.set_device(spec.device_id)
    else:
        torch.set_num_threads(1)  # one CPU "GPU" per rank
    dist.init_process_group(
        "nccl" if is_gpu else "gloo",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(minutes=30),
    )
    return spec.device


class TrainerGroup:
    """The trainer's workers, driven together: one local `TrainerWorker` (its calls on worker
    threads) or one Ray actor per rank (its calls as remote calls). Each method is the
    worker's method of the same name on every rank at once (a collective); where the ranks
    agree, rank 0's answer."""

    def __init__(self, workers: list[Any], *, is_remote: bool) -> None:
        self.workers = workers
        self.is_remote = is_remote

    async def pad_id(self) -> int:
        return (await self._all(TrainerWorker.pad_id))[0]

    async def data_parallel_ranks(self) -> list[int]:
        """Each rank's data-parallel rank: which batch it trains on."""
        return await self._all(TrainerWorker.data_parallel_rank)

    async def engine_reserve_bytes(self) -> list[int]:
        """Per rank: what an engine sharing its GPU leaves out of its KV cache."""
        return await self._all(TrainerWorker.engine_reserve_bytes)

    async def train_step(self, batches: list[Any]) -> dict[str, float]:
        """Rank i steps on `batches[i]`; rank 0's metrics."""
        return (await self._each(TrainerWorker.train_step, [(b,) for b in batches]))[0]

    async def sequence_logprobs(
        self, token_ids: list[int], start: int, masks: tuple[list[int], list[float]] | None = None
    ) -> list[float]:
        return (await self._all(TrainerWorker.sequence_logprobs, token_ids, start, masks))[0]

    async def connect_engines(self, targets: list[list[Any]], transport: Transport) -> None:
        """Rank i sends its weights to `targets[i]` from now on."""
        await self._each(TrainerWorker.connect_engines, [(t, transport) for t in targets])

    async def send_weights(self, version: int) -> dict[str, float]:
        """Every rank exports; ranks with engines send. Rank 0's bytes and timings."""
        return (await self._all(TrainerWorker.send_weights, version))[0]

    async def save(self, directory: str) -> None:
        await self._all(TrainerWorker.save, directory)

    async def load(self, directory: str) -> None:
        await self._all(TrainerWorker.load, directory)

    async def shutdown(self) -> None:
        await self._all(TrainerWorker.shutdown)

    def _call(self, worker: Any, method: Callable[..., Any], *args: Any) -> Any:
        """`method` of `worker`: on a worker thread, or as a remote call of an actor's handle
        (which has each method of the worker's class under its name)."""
        bound = getattr(worker, method.__name__)
        return bound.remote(*args) if self.is_remote else asyncio.to_thread(bound, *args)

    async def _all(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        return list(await asyncio.gather(*(self._call(w, method, *args) for w in self.workers)))

    async def _each(self, method: Callable[..., Any], args: list[tuple[Any, ...]]) -> list[Any]:
        calls = (self._call(w, method, *a) for w, a in zip(self.workers, args, strict=True))
        return list(await asyncio.gather(*calls))
