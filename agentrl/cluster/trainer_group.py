"""The trainer group: one Ray actor per trainer rank, each holding the `train.backend` backend
(`TorchBackend`: FSDP2 across the ranks; `MegatronBackend`: TP x PP x DP) inside one
torch.distributed group (NCCL on GPU, gloo on CPU), and the weight sync
from the ranks to the engines: CUDA IPC / shared memory to the colocated engine, a broadcast from
rank 0 to every engine rank, or a checkpoint directory on disk."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from agentrl.config import RunConfig
from agentrl.weight_buckets import nbytes

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class RankSpec:
    rank: int
    world_size: int
    device_id: int
    use_gpu: bool
    master_addr: str
    master_port: int
    model_path: str
    num_optimizer_steps: int
    shares_device: bool = False  # colocated: an engine resumes into this GPU after each step
    api_key: str | None = None  # the engines' --api-key (read on the driver, not in the actor)


def with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Each item with whether it is the last: the weight version goes with the last bucket."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def _copy_model_files(model_path: str, out: Path) -> None:
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja"):  # fmt: skip
        if (Path(model_path) / name).is_file():
            shutil.copyfile(Path(model_path) / name, out / name)


class TrainerRank:
    """Ray actor body for one rank. Every collective method is called on all ranks at once."""

    def __init__(self, spec: RankSpec, cfg: RunConfig) -> None:
        import torch
        import torch.distributed as dist

        from agentrl.trainer.backend import make_trainer_backend
        from agentrl.trainer.weights import serving_dtype

        self.spec, self.cfg = spec, cfg
        os.environ.update(
            MASTER_ADDR=spec.master_addr,
            MASTER_PORT=str(spec.master_port),
            RANK=str(spec.rank),
            WORLD_SIZE=str(spec.world_size),
            LOCAL_RANK=str(spec.device_id),
        )
        if spec.use_gpu:
            torch.cuda.set_device(spec.device_id)
            device = f"cuda:{spec.device_id}"
        else:
            torch.set_num_threads(1)  # one CPU "GPU" per rank
            device = "cpu"
        dist.init_process_group(
            "nccl" if spec.use_gpu else "gloo",
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(minutes=30),
        )
        self.backend = make_trainer_backend(
            spec.model_path,
            cfg.train,
            cfg.algo,
            device=device,
            dtype=cfg.model.dtype,
            temperature=cfg.rollout.rollout_temperature,
            num_optimizer_steps=spec.num_optimizer_steps,
        )
        # HTTP and the broadcast group's handshake are async: one loop of this actor's own runs
        # them (Ray may already run a loop on the calling thread), so the clients stay bound to it.
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="weight-sync", daemon=True).start()
        self._targets: list[Any] = []  # SGLangEngine clients this rank pushes weights to
        self._sender: Any = None  # DistributedWeightSender (rank 0, disaggregated)
        self.transport = "tensor"
        self._dtype = serving_dtype(cfg.model.dtype, spec.use_gpu)

    # -- training

    def pad_id(self) -> int:
        return self.backend.pad_id

    def data_parallel_rank(self) -> int:
        """Which of `build_train_batches(..., dp_size)`'s batches this rank trains on: its own
        rank under FSDP; under Megatron its replica's (the TP and PP ranks of a replica share the
        batch). Collective under Megatron the first time (it builds the model and its groups)."""
        if self.cfg.train.backend == "megatron":
            return self.backend.dp_rank  # type: ignore[attr-defined]
        return self.spec.rank

    @property
    def _is_state_offloaded(self) -> bool:
        """Between steps the optimizer state waits in host memory (--offload-train)."""
        return self.spec.shares_device and self.spec.use_gpu and self.cfg.cluster.offload_train

    def engine_reserve_bytes(self) -> int:
        """What an engine sharing this GPU leaves out of its KV cache: the optimizer state
        this rank creates at its first step (none when it waits in host memory between steps).
        Loads the model first either way."""
        reserve = self.backend.pending_state_bytes() if self.spec.use_gpu else 0
        return 0 if self._is_state_offloaded else reserve

    def train_step(self, batch: Any) -> dict[str, float]:
        metrics = self.backend.train_step(batch)
        if self.spec.shares_device:  # the engine's KV cache resumes into what the step used
            self.backend.free_step_memory()
        if self._is_state_offloaded:
            t0 = time.perf_counter()
            self.backend.offload_state()
            metrics["time/offload_state_s"] = time.perf_counter() - t0
        return metrics

    def sequence_logprobs(self, token_ids: list[int], start: int) -> list[float]:
        return self.backend.sequence_logprobs(token_ids, start)

    def save(self, directory: str) -> None:
        self.backend.save(directory)

    def load(self, directory: str) -> None:
        self.backend.load(directory)
        if self._is_state_offloaded:
            self.backend.offload_state()

    def memory_allocated_bytes(self) -> int:
        import torch

        return int(torch.cuda.memory_allocated()) if self.spec.use_gpu else 0

    # -- weight sync

    def connect_engines(self, urls: list[str], transport: str) -> None:
        """tensor: this rank pushes to the engines in `urls` (those sharing its device);
        distributed: rank 0 joins one broadcast group with every engine rank in `urls`."""
        from agentrl.engine.sglang import SGLangEngine
        from agentrl.engine.sglang.weight_sender import DistributedWeightSender

        self.close_engines()
        self.transport = transport
        api_key = self.spec.api_key
        self._targets = [SGLangEngine(u, request_timeout_s=600.0, api_key=api_key) for u in urls]
        if transport == "distributed" and self._targets:
            self._sender = DistributedWeightSender(
                self._targets, master_address=self.spec.master_addr
            )
            self._run(self._sender.connect())

    def sync_weights(self, version: str) -> dict[str, float]:
        """Every rank iterates the export (it gathers the shards); this rank sends what it owns.
        Returns the bytes exported and the wall time split into exporting and sending."""
        size = self.cfg.cluster.update_weight_buffer_size
        if self.transport == "disk":
            return self._sync_from_disk(version, size)
        num_bytes, send_s, t0 = 0, 0.0, time.perf_counter()
        if self._targets:  # one weight-update session per engine around all the buckets
            self._run(self._each_target("begin_weight_update"))
        for bucket, is_last in with_last(self.backend.export_weights(size, dtype=self._dtype)):
            num_bytes += sum(nbytes(t) for _, t in bucket)
            if self._targets:
                t_send = time.perf_counter()
                self._run(self._send(bucket, version if is_last else None))
                send_s += time.perf_counter() - t_send
        if self._targets:  # closes the session, then flushes the prefix cache
            self._run(self._each_target("end_weight_update"))
        if self.spec.shares_device:  # the buckets' cached blocks: the KV cache resumes next
            self.backend.free_step_memory()
        total_s = time.perf_counter() - t0
        return {"bytes": float(num_bytes), "export_s": total_s - send_s, "send_s": send_s}

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _each_target(self, method: str) -> None:
        await asyncio.gather(*(getattr(t, method)() for t in self._targets))

    async def _send(self, bucket: list[tuple[str, Any]], version: str | None) -> None:
        if self._sender is not None:
            await self._sender.send(bucket, weight_version=version)
            return
        # tensor: flattened per dtype, IPC handles (GPU) or shared memory (CPU), same host only.
        # The version changes with the last bucket only.
        await asyncio.gather(
            *(
                t.update_weights(bucket, weight_version=version or t.weight_version)
                for t in self._targets
            )
        )

    def _sync_from_disk(self, version: str, size: int) -> dict[str, float]:
        from safetensors.torch import save_file

        num_bytes, t0, send_s = 0, time.perf_counter(), 0.0
        out = Path(tempfile.mkdtemp(prefix="agentrl-weights-"))
        try:
            for i, bucket in enumerate(self.backend.export_weights(size, dtype=self._dtype)):
                num_bytes += sum(nbytes(t) for _, t in bucket)
                if self.spec.rank == 0:
                    tensors = {n: t.detach().cpu().contiguous() for n, t in bucket}
                    save_file(tensors, str(out / f"model-{i:05d}.safetensors"))
            if self.spec.rank == 0 and self._targets:
                _copy_model_files(self.spec.model_path, out)  # SGLang loads a whole model dir
                t_send = time.perf_counter()
                self._run(self._post_disk(str(out), version))
                send_s = time.perf_counter() - t_send
        finally:
            shutil.rmtree(out, ignore_errors=True)
        total_s = time.perf_counter() - t0
        return {"bytes": float(num_bytes), "export_s": total_s - send_s, "send_s": send_s}

    async def _post_disk(self, path: str, version: str) -> None:
        await asyncio.gather(
            *(t.update_weights_from_disk(path, weight_version=version) for t in self._targets)
        )

    def close_engines(self) -> None:
        if self._sender is not None:
            self._run(self._sender.close())
            self._sender = None
        self._targets = []

    def shutdown(self) -> None:
        import torch.distributed as dist

        self.close_engines()
        if dist.is_initialized():
            dist.barrier()
