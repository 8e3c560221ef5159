"""`EngineMemory`: what a `LocalEngine` holds on its device and gives back while a colocated
trainer runs, by SGLang's tags: "weights" and "kv_cache" (the KV arena).

With `torch_memory_saver` (CUDA) both live in pausable regions: a release unmaps their pages
and a resume maps fresh ones at the same addresses, so tensors, the arena's size and CUDA graphs
stay valid. Without it a release moves the weights to the host (or drops them, when the trainer
sends every weight again) and frees the arena, and a resume sizes a new arena from the memory
free then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from agentrl.engine.local.attention import flash_reads_head_major
from agentrl.engine.local.device_memory import PAGE_BYTES, PausableMemory, require_free
from agentrl.engine.local.kv_arena import KVArena
from agentrl.engine.local.param_storage import (
    DroppedParameters,
    Groups,
    all_unsent,
    drop_parameters,
    mark_written,
    pack_parameters,
    reallocate_parameters,
)

logger = logging.getLogger(__name__)


class EngineMemory:
    """The weights of `model` (packed into a pausable region when `pausable` and the saver is
    installed) and the tags given back. `weights_cpu_backup=False`: a release drops the weights
    instead of keeping a host copy. `groups`: parameters placed back to back whenever storage is
    laid out here (packing, re-allocation)."""

    def __init__(
        self,
        model: Any,
        device: str,
        *,
        pausable: bool,
        weights_cpu_backup: bool,
        mem_fraction_static: float,
        groups: Groups = (),
    ) -> None:
        self.model = model
        self.device = device
        self.groups = groups  # parameters kept back to back (the fused projections' members)
        self.weights_cpu_backup = weights_cpu_backup
        self.mem_fraction_static = mem_fraction_static  # named in the error of a failed resume
        self.pausable = PausableMemory.create(device) if pausable else None
        if self.pausable is not None:
            with self.pausable.region("weights", cpu_backup=weights_cpu_backup):
                pack_parameters(model, device, groups)
            torch.cuda.empty_cache()  # the storage the weights were loaded into
        self.released: set[str] = set()  # tags given back
        self.dropped: DroppedParameters | None = None  # weights dropped by a release, not resent
        self.host_weights: list[torch.Tensor] | None = None  # a pausable release's host copy
        # Seconds the last resume took per tag, measured here (server info reports them, so a
        # caller can tell the engine's share from the HTTP round trip's).
        self.last_resume_s: dict[str, float] = {}

    @property
    def is_pausable(self) -> bool:
        return self.pausable is not None

    @property
    def is_ready(self) -> bool:
        """Whether the model can run: nothing given back, no dropped weight waiting to be sent."""
        return not self.released and self.dropped is None

    def allocate(self, arena: KVArena) -> None:
        # Head-major buffers where FlashAttention reads them (probed before any region opens).
        head_major = flash_reads_head_major(self.device, arena.dtype)
        if self.pausable is None:
            arena.allocate(self.device, head_major=head_major)
            return
        with self.pausable.region("kv_cache"):
            arena.allocate(self.device, head_major=head_major)

    def held_bytes(self, arena: KVArena) -> int:
        """Device memory held (0 on CPU). The allocator counts the tensors of paused regions as
        allocated, but their pages are back with the driver: not counted."""
        if self.device == "cpu":
            return 0
        held = torch.cuda.memory_allocated(self.device)
        if self.pausable is not None:
            if "weights" in self.released:
                held -= sum(p.numel() * p.element_size() for p in self.model.parameters())
            if "kv_cache" in self.released:
                held -= arena.nbytes
        return max(0, held)

    def weights_written(self, tensors: list[torch.Tensor]) -> None:
        """Weights an update wrote in place; once every dropped one is written again after the
        resume, nothing is missing."""
        for tensor in tensors:
            mark_written(self.dropped, tensor)
        if self.dropped is not None and "weights" not in self.released and not self.dropped.unsent:
            self.dropped = None

    # ------------------------------------------------------------------ release and resume

    def release(self, keep_weights: bool) -> None:
        """Give back the weights and the KV arena (the engine has preempted its requests, and
        freed the arena's buffers when they are not pausable)."""
        if self.pausable is not None:
            self._pause(keep_weights)
        elif keep_weights:
            self.model.to("cpu")
        else:
            self.dropped = drop_parameters(self.model)
        if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # cached per stream, not in use
            torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        self.released = {"weights", "kv_cache"}

    def _pause(self, keep_weights: bool) -> None:
        """Unmap the pages of the weights and the arena; their addresses (and graphs) stay."""
        assert self.pausable is not None
        params = list(self.model.parameters())
        if keep_weights and not self.weights_cpu_backup:  # the region keeps no host copy itself
            self.host_weights = [p.detach().to("cpu") for p in params]
        elif not keep_weights and not self.weights_cpu_backup:
            self.dropped = all_unsent(self.model)
        self.pausable.pause("weights")
        self.pausable.pause("kv_cache")

    def resume(self, tags: set[str], arena: KVArena, size_arena: Callable[..., KVArena]) -> KVArena:
        """Take back the released tags among `tags`; the KV arena after it: the same one when
        pausable, else a new one from `size_arena` (sized from the memory free now: a colocated
        trainer's optimizer state, once created, is held already, so no reserve is left for it
        a second time)."""
        resumed = tags & self.released
        t0 = time.perf_counter()
        if "weights" in resumed:
            self._resume_weights()
            self.released.discard("weights")
        t1 = time.perf_counter()
        if "kv_cache" in resumed:
            if self.pausable is not None:
                self.require_room("kv_cache", arena)
                self.pausable.resume("kv_cache")
                arena.mark_dirty()  # fresh pages: nothing in them was written
            else:
                arena = size_arena(reserve_bytes=0)
                self.allocate(arena)
            self.released.discard("kv_cache")
        t2 = time.perf_counter()
        self.last_resume_s = {
            tag: dt for tag, dt in (("weights", t1 - t0), ("kv_cache", t2 - t1)) if tag in resumed
        }
        logger.info(
            "LocalEngine resumed %s: weights %.3f s, KV arena (%.1f GB) %.3f s",
            sorted(tags),
            t1 - t0,
            arena.nbytes / 1e9,
            t2 - t1,
        )
        return arena

    def _resume_weights(self) -> None:
        if self.pausable is None:
            if self.dropped is not None:
                reallocate_parameters(self.dropped, self.device, self.groups)
            self.model.to(self.device)
            return
        self.require_room("weights")
        self.pausable.resume("weights")
        if self.host_weights is not None:
            with torch.no_grad():
                for param, host in zip(self.model.parameters(), self.host_weights, strict=True):
                    param.copy_(host)
            self.host_weights = None

    def require_room(self, tag: str, arena: KVArena | None = None) -> None:
        """Refuse a resume whose pages cannot be mapped (see `require_free`), naming the fix."""
        if tag == "weights":
            params = list(self.model.parameters())
            needed = sum(p.numel() * p.element_size() for p in params)
            granules = len({p.dtype for p in params})  # one packed block per dtype
        else:
            assert arena is not None
            needed = arena.nbytes
            granules = 2 * arena.num_layers
        require_free(
            self.device,
            needed + PAGE_BYTES * (granules + 1),
            f"the engine's {tag}",
            f"lower engine.mem_fraction_static (now {self.mem_fraction_static}): the KV arena was "
            "sized from the memory free at start, and the trainer on this GPU now holds more (its "
            "optimizer state appears at its first step)",
        )

    def close(self, arena: KVArena) -> None:
        """Give the pausable regions' pages back to the device (no-op without them)."""
        if self.pausable is None:
            return
        arena.free_buffers()
        drop_parameters(self.model)
        self.pausable.close()
