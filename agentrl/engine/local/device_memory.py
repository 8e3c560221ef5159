"""Pausable device memory for a colocated engine, through `torch_memory_saver` (what SGLang uses):
tensors allocated in a tagged region keep their virtual addresses when the memory is paused (the
physical pages go back to the driver) and resumed (fresh pages mapped at the same addresses). So
pausing the weights and the KV arena frees the GPU for the trainer, and resuming them takes a few
driver calls, with no allocator round trip, no new tensors and CUDA graphs that stay valid.

Optional (extra `cuda`): without the package, or off CUDA, `PausableMemory.create` returns None and
the engine frees and re-allocates its tensors instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

_engine_ids = itertools.count()


def _keep_pools_past_exit(saver: Any) -> None:
    """The saver (hook mode "torch") frees a pool's blocks only inside a region, and checks it:
    destroyed at interpreter exit, outside any region, its pools ended a run that had succeeded
    with exit status 1 ("only support interesting region"). The pools are kept alive past
    Python's finalisation instead (one reference that is never dropped); the driver takes the
    memory back when the process ends."""
    pools = getattr(getattr(saver, "_impl", None), "_mem_pools", None)
    if pools is not None and not getattr(saver, "_agentrl_pools_kept", False):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pools))
        saver._agentrl_pools_kept = True


PAGE_BYTES = 2 << 20  # the driver maps physical memory in 2 MiB granules


def require_free(device: str, needed: int, what: str, fix: str) -> None:
    """Raise EngineMemoryError unless `needed` bytes are free on `device`: the saver cannot report
    a failed mapping (it ends the process), so a resume that cannot fit is refused before it."""
    import torch

    from agentrl.engine.base import EngineMemoryError

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    if free < needed:
        raise EngineMemoryError(
            f"resuming {what} needs {needed / 2**30:.2f} GiB on {device}, but only "
            f"{free / 2**30:.2f} GiB are free; {fix}"
        )


class PausableMemory:
    """One engine's tagged regions ("weights", "kv_cache"), named apart from any other engine's
    in the process (the saver is one per process)."""

    def __init__(self, saver: Any) -> None:
        self._saver = saver
        self._prefix = f"agentrl-engine-{next(_engine_ids)}"
        self._paused: set[str] = set()

    @classmethod
    def create(cls, device: str) -> PausableMemory | None:
        if not device.startswith("cuda"):
            return None
        try:
            from torch_memory_saver import (  # pyright: ignore[reportMissingImports]  (cuda extra)
                torch_memory_saver as saver,
            )

            with contextlib.suppress(AttributeError, AssertionError):  # set before first use
                saver.hook_mode = "torch"  # a pluggable allocator: no LD_PRELOAD needed
            memory = cls(saver)
            with memory.region("probe"):
                pass  # loads the allocator now: a missing CUDA runtime fails here, not later
            _keep_pools_past_exit(saver)
            return memory
        except Exception as e:  # ImportError, or a saver that cannot load on this machine
            logger.info(
                "torch_memory_saver unavailable (%s): release_memory frees and resume_memory "
                "re-allocates the engine's tensors (pip install 'agentrl[cuda]' to keep them)",
                e,
            )
            return None

    def tag(self, name: str) -> str:
        return f"{self._prefix}:{name}"

    @contextlib.contextmanager
    def region(self, name: str, *, cpu_backup: bool = False) -> Iterator[None]:
        """Tensors allocated inside are paused and resumed with `name`; with `cpu_backup` their
        contents are copied to host memory on pause and back on resume."""
        with self._saver.region(tag=self.tag(name), enable_cpu_backup=cpu_backup):
            yield

    def pause(self, name: str) -> None:
        if name not in self._paused:
            self._saver.pause(self.tag(name))
            self._paused.add(name)

    def resume(self, name: str) -> None:
        if name in self._paused:
            self._saver.resume(self.tag(name))
            self._paused.discard(name)

    def close(self, names: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """The engine dropped its tensors: give their pages back to the device. The saver frees a
        block only inside its region and keeps each region's allocator pool for the process's
        lifetime, so the dropped blocks stay cached in the pools, paused: they hold address space,
        no device memory (a next engine gets regions of its own)."""
        for name in names:
            self.pause(name)
