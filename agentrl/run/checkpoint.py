"""A run's checkpoints: the trainer's state and the loop's (step, data cursor, evals, config, RNG)
in one step directory, written atomically; resuming checks that no file in it can run code, reads
both back and brings the engines to the saved policy before the first rollout."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agentrl.run.run_dir import RunDirError
from agentrl.trainer.checkpoint import (
    capture_rng_state,
    find_latest,
    restore_rng_state,
    save_checkpoint,
)
from agentrl.trainer.checkpoint_safety import (
    UnsafeCheckpointError,
    check_checkpoint,
    weights_only_load,
)

if TYPE_CHECKING:
    from agentrl.config import CheckpointConfig
    from agentrl.data import TaskSource
    from agentrl.deploy.runtime import Runtime

log = logging.getLogger(__name__)

LOOP_STATE = "loop_state.json"
OLD_LOOP_STATE = "loop_state.pt"  # before JSON: torch.save'd, read weights-only


async def save_run(
    run_dir: Path, runtime: Runtime, loop_state: dict[str, Any], keep_last: int
) -> Path:
    """`checkpoints/step_N` under `run_dir` (N = loop_state["step"]): the trainer's shards (it
    saves on the event loop) and `loop_state.json` with the RNG state added; the last `keep_last`
    kept. A full disk raises `CheckpointSaveError`, one line that names the command to resume."""
    state = {**loop_state, "rng": capture_rng_state()}
    text = json.dumps(state, default=_plain)  # before the save: a bad value fails it whole
    loop = asyncio.get_running_loop()

    def write(tmp_dir: Path) -> None:  # on a worker thread; the trainer saves on the loop
        asyncio.run_coroutine_threadsafe(runtime.save(tmp_dir), loop).result()
        (tmp_dir / LOOP_STATE).write_text(text, encoding="utf-8")

    return await asyncio.to_thread(
        save_checkpoint,
        run_dir / "checkpoints",
        state["step"],
        write,
        keep_last=keep_last,
        resume_command=f"agentrl train --resume {run_dir}",
    )


def _plain(value: Any) -> Any:
    """numpy scalars (an eval summary's statistics) as Python numbers."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def checkpoint_to_resume(resume: str) -> Path:
    """The step dir `--resume` names: the run dir's latest, or the step dir itself."""
    root = Path(resume)
    is_step = (root / LOOP_STATE).exists() or (root / OLD_LOOP_STATE).exists()
    ckpt = find_latest(root / "checkpoints") or find_latest(root) or (root if is_step else None)
    if ckpt is None:
        raise RunDirError(
            f"--resume {str(root)!r}: no complete checkpoint found there (looked for step_* dirs)"
        )
    return ckpt


def read_loop_state(ckpt: Path) -> dict[str, Any]:
    """`loop_state.json`; a checkpoint from before JSON, its `loop_state.pt` loaded weights-only
    (tensors, numpy arrays and plain values: what it held)."""
    path = ckpt / LOOP_STATE
    if not path.exists() and (ckpt / OLD_LOOP_STATE).exists():
        state = weights_only_load(ckpt / OLD_LOOP_STATE, str(ckpt / OLD_LOOP_STATE))
    else:
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UnsafeCheckpointError(
                f"{path}: not a loop state ({type(e).__name__}: {e}); resume from another "
                "checkpoint of the run (pass its step dir to --resume)"
            ) from None
    if not isinstance(state, dict) or not {"step", "data", "rng"} <= state.keys():
        raise UnsafeCheckpointError(
            f"{path}: not a loop state (no step, data and rng); resume from another checkpoint "
            "of the run (pass its step dir to --resume)"
        )
    return state


async def resume_run(
    cfg: CheckpointConfig, runtime: Runtime, source: TaskSource
) -> tuple[int, list[dict[str, Any]]]:
    """With `checkpoint.resume` (a run dir or one of its step dirs): the trainer, the data
    cursor and the RNG restored, the engines synced to that policy; the step to start from and
    the evaluations so far. Without: (0, []). Every pickle of the checkpoint is checked first."""
    if not cfg.resume:
        return 0, []
    ckpt = checkpoint_to_resume(cfg.resume)
    check_checkpoint(ckpt)
    extra = read_loop_state(ckpt)
    await runtime.load(ckpt)
    source.load_state(extra["data"])
    restore_rng_state(extra["rng"])
    await runtime.sync_weights(version=int(extra["step"]))
    log.info("resumed from %s at step %d", ckpt, extra["step"])
    return int(extra["step"]), list(extra.get("evals", []))
