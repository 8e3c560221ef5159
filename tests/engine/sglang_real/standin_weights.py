"""The weight and memory half of the stand-in for SGLang's scheduler: weight updates (tensor,
distributed, disk, version), weight-update sessions and memory release/resume by tags, answered
as SGLang's scheduler answers (0.5.23: managers/scheduler_components/weight_updater.py,
model_executor/model_runner_components/weight_updater.py, managers/tp_worker.py).

What runs is SGLang's own code where it is not the GPU: `MultiprocessingSerializer` (its safe
unpickler), `monkey_patch_torch_reductions`, `FlattenedTensorBucket`, `init_custom_process_group`
over gloo and a real broadcast receive. The "model" is a dict of the tensors received."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path
from typing import Any

# The 0.5.23 scheduler's refusals, word for word (weight_updater.py).
OUTSIDE_SESSION = "{op} must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)
IDLE_ASSERT = "release_memory_occupation should be called only when server is idle."


class WeightStandIn:
    """Mixed into `StandInTokenizerManager`; `has_sessions`: the SGLang version's app has
    `/begin_weight_update` (0.5.2x), so its scheduler refuses tensor and distributed updates
    outside a session."""

    def _init_weights(self, sglang: Any, *, tp_size: int, has_sessions: bool) -> None:
        from sglang.srt import constants

        self.tp_size = tp_size
        self.has_sessions = has_sessions
        self.in_session = False
        self.weights: dict[str, Any] = {}  # the "model": name -> tensor received
        self.num_weight_loads = 0
        self.groups: dict[str, Any] = {}
        self.offload_tags: set[str] = set()  # released and not resumed
        self.memory_saver_paused: set[str] = set()  # what a memory saver actually freed
        self.all_memory_tags = list(constants.GPU_MEMORY_ALL_TYPES)
        self.death: str | None = None

    def _session_refusal(self, op: str) -> tuple[bool, str] | None:
        if self.has_sessions and not self.in_session:
            return False, OUTSIDE_SESSION.format(op=op)
        return None

    def _after_update(self, obj: Any) -> tuple[bool, str]:
        """SchedulerWeightUpdaterManager: record the version, then flush the cache the old weights
        filled (the update fails when the flush is refused)."""
        self.num_weight_loads += 1
        version = getattr(obj, "weight_version", None)
        if version is not None:
            self.weight_version = version
        if getattr(obj, "flush_cache", False):
            if not self.is_fully_idle(ignore_waiting=self.is_pause):
                return False, NOT_FLUSHED
            self.reset_prefix_cache()
        return True, "Success"

    async def _locked(self, fn: Any, *args: Any) -> Any:
        """TokenizerManager: a paused engine updates at once; otherwise the update waits for the
        writer lock (every running request done)."""
        async with self.is_pause_cond:
            is_paused = self.is_pause
        if is_paused:
            return await fn(*args)
        async with self.model_update_lock.writer_lock:
            return await fn(*args)

    # -- sessions

    async def begin_weight_update(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        if self.in_session:
            return False, SESSION_OPEN
        self.in_session = True
        return True, "Success"

    async def end_weight_update(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        if not self.in_session:
            return False, NO_SESSION
        self.in_session = False
        return True, "Success"

    # -- tensor updates

    async def update_weights_from_tensor(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        return await self._locked(self._load_tensor_payloads, obj)

    async def _load_tensor_payloads(self, obj: Any) -> tuple[bool, str]:
        refusal = self._session_refusal("update_weights_from_tensor")
        if refusal is not None:
            return refusal
        payloads = list(obj.serialized_named_tensors)
        loaded: dict[str, Any] = {}
        for tp_rank in range(self.tp_size):
            # TpModelWorker.deserialize_own_rank: rank r opens payloads[r] only (the scheduler of a
            # rank without one dies of the IndexError; the stand-in answers it instead).
            if tp_rank >= len(payloads):
                return False, f"IndexError: rank {tp_rank} has no payload ({len(payloads)} sent)"
            try:
                named = self._deserialize(payloads[tp_rank])
                loaded.update(self._reconstruct(named, obj.load_format))
            except Exception as e:  # the scheduler process dies on these; report instead
                return False, f"{type(e).__name__}: {e}"
        self.weights.update({k: v.clone() for k, v in loaded.items()})
        return self._after_update(obj)

    def _deserialize(self, payload: Any) -> Any:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        return MultiprocessingSerializer.deserialize(payload)

    def _reconstruct(self, named: Any, load_format: str | None) -> dict[str, Any]:
        from sglang.srt.weight_sync.tensor_bucket import (
            FlattenedTensorBucket,
            FlattenedTensorMetadata,
        )

        if load_format != "flattened_bucket":
            return {name: tensor for name, tensor in named}
        metadata = [
            FlattenedTensorMetadata(
                name=m.name,
                shape=m.shape,
                dtype=m.dtype,
                start_idx=m.start_idx,
                end_idx=m.end_idx,
                numel=m.numel,
            )
            for m in named["metadata"]
        ]
        bucket = FlattenedTensorBucket(
            flattened_tensor=named["flattened_tensor"], metadata=metadata
        )
        return dict(bucket.reconstruct_tensors())

    # -- distributed updates

    async def init_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return await asyncio.to_thread(self._join_group, obj)

    def _join_group(self, obj: Any) -> tuple[bool, str]:
        from sglang.srt.utils import init_custom_process_group

        if self.tp_size != 1:
            return False, "the stand-in joins weight-update groups as one rank (tp_size 1)"
        try:
            self.groups[obj.group_name] = init_custom_process_group(
                backend=obj.backend,
                init_method=f"tcp://{obj.master_address}:{obj.master_port}",
                world_size=obj.world_size,
                rank=obj.rank_offset,  # rank_offset + tp_rank, tp_rank 0
                group_name=obj.group_name,
            )
        except Exception as e:
            return False, f"Failed to initialize custom process group: {e}."
        return True, "Succeeded to initialize custom process group."

    async def destroy_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        import torch.distributed as dist

        pg = self.groups.pop(obj.group_name, None)
        if pg is None:
            return False, "The group to be destroyed does not exist."
        await asyncio.to_thread(dist.destroy_process_group, pg)
        return True, "Succeeded to destroy custom process group."

    async def update_weights_from_distributed(
        self, obj: Any, request: Any = None
    ) -> tuple[bool, str]:
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        return await self._locked(self._receive_distributed, obj)

    async def _receive_distributed(self, obj: Any) -> tuple[bool, str]:
        refusal = self._session_refusal("update_weights_from_distributed")
        if refusal is not None:
            return refusal
        if obj.group_name not in self.groups:
            return False, f"Group {obj.group_name} not in {list(self.groups)}"
        try:
            received = await asyncio.to_thread(self._receive, obj)
        except Exception as e:
            return False, f"Failed to receive weights: {e}"
        self.weights.update(received)
        return self._after_update(obj)

    def _receive(self, obj: Any) -> dict[str, Any]:
        """The model runner's receive: one broadcast per tensor, or one flat bucket."""
        import torch
        import torch.distributed as dist
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        group = self.groups[obj.group_name]
        dtypes = [d if isinstance(d, torch.dtype) else getattr(torch, d) for d in obj.dtypes]
        if obj.load_format == "flattened_bucket":
            if hasattr(FlattenedTensorBucket, "empty"):  # 0.5.2x: a byte buffer
                bucket = FlattenedTensorBucket.empty(obj.names, obj.dtypes, obj.shapes, "cpu")
            else:
                empties = [
                    (n, torch.empty(s, dtype=d))
                    for n, d, s in zip(obj.names, dtypes, obj.shapes, strict=True)
                ]
                bucket = FlattenedTensorBucket(named_tensors=empties)
            dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
            return dict(bucket.reconstruct_tensors())
        out = {}
        for name, dtype, shape in zip(obj.names, dtypes, obj.shapes, strict=True):
            out[name] = torch.empty(shape, dtype=dtype)
            dist.broadcast(out[name], src=0, group=group)
        return out

    # -- disk and version

    async def update_weights_from_disk(
        self, obj: Any, request: Any = None
    ) -> tuple[bool, str, int]:
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        success, message = await self._locked(self._load_from_disk, obj)
        return success, message, 0

    async def _load_from_disk(self, obj: Any) -> tuple[bool, str]:
        from safetensors.torch import load_file

        files = sorted(Path(obj.model_path).glob("*.safetensors"))
        if not files:
            return False, f"Failed to get weights iterator: no safetensors in {obj.model_path}."
        for path in files:
            self.weights.update(load_file(str(path)))
        self.model_path = obj.model_path
        return self._after_update(obj)

    async def update_weight_version(self, obj: Any) -> None:
        self.weight_version = obj.new_version

    # -- memory

    async def release_memory_occupation(self, obj: Any, request: Any = None) -> None:
        if not self.is_fully_idle(ignore_waiting=self.is_pause):
            self.die(f"AssertionError: {IDLE_ASSERT}")
        tags = obj.tags or self.all_memory_tags
        self.offload_tags.update(tags)
        if self.server_args.enable_memory_saver:  # without it the adapter does nothing
            self.memory_saver_paused.update(tags)
        if "kv_cache" in tags:
            self.reset_prefix_cache()

    async def resume_memory_occupation(self, obj: Any, request: Any = None) -> None:
        tags = obj.tags or self.all_memory_tags
        for tag in tags:
            if tag not in self.offload_tags:  # weight_updater: offload_tags.remove(tag)
                self.die(f"KeyError: {tag!r} resumed but never released")
            self.offload_tags.remove(tag)
            self.memory_saver_paused.discard(tag)

    def die(self, reason: str) -> None:
        """An exception in SGLang's scheduler takes the whole server down (SIGQUIT to the
        parent): so does the stand-in, without answering."""
        self.death = reason
        print(f"stand-in scheduler died: {reason}", flush=True)
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
        raise SystemExit(reason)
