"""A run's checkpoints: the trainer's state and the loop's (step, data cursor, evals, config, RNG)
in one step directory, written atomically; resuming reads both back and brings the engines to the
saved policy before the first rollout."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentrl.run.run_dir import RunDirError
from agentrl.trainer.checkpoint import (
    capture_rng_state,
    find_latest,
    restore_rng_state,
    save_checkpoint,
)

if TYPE_CHECKING:
    from agentrl.config import CheckpointConfig
    from agentrl.data import TaskSource
    from agentrl.run.runtime import Runtime

log = logging.getLogger(__name__)


async def save_run(
    run_dir: Path, runtime: Runtime, loop_state: dict[str, Any], keep_last: int
) -> Path:
    """`checkpoints/step_N` under `run_dir` (N = loop_state["step"]): the trainer's shards (it
    saves on the event loop) and `loop_state.pt` with the RNG state added; the last `keep_last`
    kept. A full disk raises `CheckpointSaveError`, one line that names the command to resume."""
    state = {**loop_state, "rng": capture_rng_state()}
    loop = asyncio.get_running_loop()

    def write(tmp_dir: Path) -> None:  # on a worker thread; the trainer saves on the loop
        asyncio.run_coroutine_threadsafe(runtime.save(tmp_dir), loop).result()
        torch.save(state, tmp_dir / "loop_state.pt")

    return await asyncio.to_thread(
        save_checkpoint,
        run_dir / "checkpoints",
        state["step"],
        write,
        keep_last=keep_last,
        resume_command=f"agentrl train --resume {run_dir}",
    )


async def resume_run(
    cfg: CheckpointConfig, runtime: Runtime, source: TaskSource
) -> tuple[int, list[dict[str, Any]]]:
    """With `checkpoint.resume` (a run dir or one of its step dirs): the trainer, the data
    cursor and the RNG restored, the engines synced to that policy; the step to start from and
    the evaluations so far. Without: (0, [])."""
    if not cfg.resume:
        return 0, []
    root = Path(cfg.resume)
    ckpt = (
        find_latest(root / "checkpoints")
        or find_latest(root)
        or (root if (root / "loop_state.pt").exists() else None)
    )
    if ckpt is None:
        raise RunDirError(
            f"--resume {str(root)!r}: no complete checkpoint found there (looked for step_* dirs)"
        )
    await runtime.load(ckpt)
    extra = torch.load(ckpt / "loop_state.pt", weights_only=False)
    source.load_state(extra["data"])
    restore_rng_state(extra["rng"])
    await runtime.sync_weights(version=str(extra["step"]))
    log.info("resumed from %s at step %d", ckpt, extra["step"])
    return int(extra["step"]), list(extra.get("evals", []))
