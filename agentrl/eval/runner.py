"""`evaluate`: k episodes per held-out task through a `RolloutRunner`, saved task by task
to a resumable JSONL file, then summarised as an `EvalReport` (report.json/md/png)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.eval.report import EvalReport, build_report, write_text_atomic
from agentrl.progress import RunProgress
from agentrl.types import EpisodeStatus, Group, StatusReason, Task, Trajectory, write_jsonl

if TYPE_CHECKING:
    from agentrl.rollout import RolloutRunner

logger = logging.getLogger(__name__)

TRAJECTORIES_FILE = "eval_trajectories.jsonl"
STATE_FILE = "eval_state.json"
IDENTITY_KEYS = ("env", "split", "model", "step", "seed")
"""`meta` keys that must match for a rerun to reuse saved trajectories."""


class ResumeMismatchError(ValueError):
    """The output directory holds episodes from a different setting (k, temperature, model...)."""


async def evaluate(
    runner: RolloutRunner,
    tasks: list[Task],
    *,
    k: int,
    temperature: float,
    out_dir: Path,
    resume: bool = True,
    progress: bool | RunProgress = True,
    seed: int | None = None,
    meta: dict[str, Any] | None = None,
) -> EvalReport:
    """Run k episodes per task, append each finished task's group to
    `out_dir/eval_trajectories.jsonl` (flushed), and write the reports into `out_dir`.

    With `resume`, tasks whose k episodes are already in the file are not run again; a
    rerun must use the same k, temperature and identity in `meta` (env, split, model,
    step, seed), else it stops with an error. Groups with an ABORTED episode are rerun.
    """
    if k < 1:
        raise ValueError(f"evaluate: k={k} must be at least 1 (episodes per task)")
    _check_unique_ids(tasks)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    if seed is not None:
        meta.setdefault("seed", seed)
    identity = {
        "k": k,
        "temperature": temperature,
        **{key: meta[key] for key in IDENTITY_KEYS if key in meta},
    }
    done = _prepare(out, identity, k, resume=resume)
    pending = [t for t in tasks if t.id not in done]
    start = time.perf_counter()
    if pending:
        done.update(
            await _run_pending(
                runner, pending, k, temperature, seed, out / TRAJECTORIES_FILE, progress
            )
        )
    meta.update(num_resumed_tasks=len(tasks) - len(pending), wall_s=time.perf_counter() - start)
    report = build_report([done[t.id] for t in tasks], k=k, temperature=temperature, meta=meta)
    report.write(out)
    return report


def _check_unique_ids(tasks: Sequence[Task]) -> None:
    if twice := [task_id for task_id, n in Counter(t.id for t in tasks).items() if n > 1]:
        raise ValueError(
            f"task id {twice[0]!r} appears twice; eval resumption keys on Task.id, so ids must be unique"
        )


# ---------------------------------------------------------------- resumption


def _prepare(out: Path, identity: dict[str, Any], k: int, *, resume: bool) -> dict[str, Group]:
    """Check the saved run matches, keep its complete groups, and record the identity."""
    path = out / TRAJECTORIES_FILE
    state_path = out / STATE_FILE
    done: dict[str, Group] = {}
    if resume and path.exists():
        if state_path.exists():
            _check_identity(json.loads(state_path.read_text()), identity, out)
        done = _complete_groups(path, k)
        # Rewrite without torn lines or partial groups, so appends start on a clean line.
        kept = [t for g in done.values() for t in g]
        write_text_atomic(path, "".join(json.dumps(t.to_json()) + "\n" for t in kept))
    else:
        path.write_text("")
    state_path.write_text(json.dumps(identity, default=str) + "\n")
    return done


def _check_identity(saved: dict[str, Any], identity: dict[str, Any], out: Path) -> None:
    for key in sorted(saved.keys() | identity.keys()):
        if json.dumps(saved.get(key), default=str) != json.dumps(identity.get(key), default=str):
            raise ResumeMismatchError(
                f"{out / TRAJECTORIES_FILE} was written with {key}={saved.get(key)!r}, this run has "
                f"{key}={identity.get(key)!r}; use another output directory or turn resume off "
                "(--no-resume) to start over"
            )


def _complete_groups(path: Path, k: int) -> dict[str, Group]:
    groups: dict[str, Group] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                traj = Trajectory.from_json(json.loads(line))
            except (ValueError, KeyError, TypeError):  # a line torn by a crash mid-write
                continue
            task_id = traj.task.get("id")
            if task_id is not None:
                groups.setdefault(str(task_id), []).append(traj)
    _repair_rewards(path, [t for group in groups.values() for t in group])
    return {
        task_id: group[:k]
        for task_id, group in groups.items()
        if len(group) >= k and all(t.status != EpisodeStatus.ABORTED for t in group[:k])
    }


def _repair_rewards(path: Path, trajectories: list[Trajectory]) -> None:
    """Stored episodes whose reward is no finite number (written before rewards were checked,
    or by hand) become what the runner makes of them now: ERROR/non_finite_reward, reward 0."""
    broken = [t for t in trajectories if not math.isfinite(t.reward)]
    for traj in broken:
        traj.info["non_finite_reward"] = repr(traj.reward)
        traj.reward = 0.0
        traj.status = EpisodeStatus.ERROR
        traj.status_reason = StatusReason.NON_FINITE_REWARD
    if broken:
        logger.warning(
            "%s: %d stored episodes have a reward that is no finite number (%s); they count as "
            "ERROR/%s, never scored",
            path,
            len(broken),
            broken[0].info["non_finite_reward"],
            StatusReason.NON_FINITE_REWARD.value,
        )


# ---------------------------------------------------------------- running


async def _run_pending(
    runner: RolloutRunner,
    tasks: list[Task],
    k: int,
    temperature: float,
    seed: int | None,
    path: Path,
    progress: bool | RunProgress,
) -> dict[str, Group]:
    """Run the tasks; each group is appended to `path` as soon as its k-th episode ends, one
    trajectory per episode (an agent's last segment), when episodes carry their task id, else
    when `run_groups` returns. The groups as saved: a resumed run reads back the same."""
    ids = {t.id for t in tasks}
    buffers: dict[str, Group] = {}
    written: dict[str, Group] = {}

    def save(task_id: str, group: Group) -> None:
        for traj in group:
            traj.task = {**traj.task, "id": task_id}
        write_jsonl(str(path), group, append=True)
        written[task_id] = group

    cfg = runner.cfg  # the token budget of these episodes: an ETA bound
    budget = len(tasks) * k * cfg.max_turns * cfg.rollout_max_response_len
    with _progress_bar(len(tasks) * k, progress, runner.sampled_tokens, budget) as advance:

        def on_episode(traj: Trajectory) -> None:
            advance()
            task_id = str(traj.task.get("id", ""))
            if task_id not in ids or task_id in written:
                return
            buffers.setdefault(task_id, []).append(traj)
            if len(buffers[task_id]) == k:
                save(task_id, buffers.pop(task_id))

        groups = await runner.run_groups(
            tasks, k, temperature=temperature, seed=seed, on_episode=on_episode
        )
    for task, group in zip(tasks, groups, strict=True):
        if task.id not in written:
            save(task.id, list(group))
    return written


@contextmanager
def _progress_bar(
    num_episodes: int, progress: bool | RunProgress, work: Callable[[], float], max_work: float
) -> Iterator[Any]:
    """Yields `advance()`: the "eval" phase of `progress` (a run's display), or of a display of
    its own, shown when `progress` is True."""
    display = progress if isinstance(progress, RunProgress) else RunProgress(enabled=progress)
    owned = contextlib.nullcontext() if display is progress else display
    phase_cm = display.phase("eval", num_episodes, "episodes", work=work, max_work=max_work)
    with owned, phase_cm as phase:
        yield phase.advance
