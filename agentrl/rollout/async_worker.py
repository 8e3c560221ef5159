"""`RolloutWorker`: fully asynchronous rollout. Groups keep running across train steps (and
across weight updates); the trainer takes finished groups as they come, oldest first, and
drops trajectories past the staleness bound when it takes them (the only staleness filter)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from agentrl.rollout.collect import (
    Collected,
    Group,
    TaskSupply,
    filter_zero_variance_groups,
    is_engine_aborted,
)
from agentrl.rollout.group import RolloutRunner
from agentrl.rollout.staleness import drop_stale
from agentrl.types import Task

log = logging.getLogger(__name__)


class DrawLedger:
    """The tasks a fully-async run drew, and which of them the trainer has taken. Groups finish
    out of order, so the source's cursor runs ahead of what was trained; `state()` is the data
    state a checkpoint must keep to resume exactly: the source as it stood before the oldest
    draw still in flight or queued, with the later draws already taken marked to skip."""

    def __init__(self, source: TaskSupply) -> None:
        self.source = source
        self._before: dict[int, dict[str, Any]] = {}  # draw -> source state before it
        self._position: dict[int, int] = {}  # draw -> the task's place in the source's order
        self._open: set[int] = set()
        self._num_draws = 0

    def draw(self) -> tuple[int, Task]:
        before = self._state_of_source()
        task = self.source.next_batch(1)[0]
        draw, self._num_draws = self._num_draws, self._num_draws + 1
        position = getattr(self.source, "position", None)
        if before is not None and position is not None:
            self._before[draw] = before
            self._position[draw] = position - 1
        self._open.add(draw)
        return draw, task

    def taken(self, draw: int) -> None:
        self._open.discard(draw)
        if not self._open:  # nothing older in flight: the snapshots are not needed any more
            self._before.clear()
            self._position.clear()

    def state(self) -> dict[str, Any] | None:
        current = self._state_of_source()
        if not self._open or current is None or min(self._open) not in self._before:
            return current
        first = min(self._open)
        base = dict(self._before[first])
        start = base["epoch"] * base["num_tasks"] + base["cursor"]  # the source's position then
        skip = {start + p for p in base.get("skip", [])}  # taken in an earlier run
        skip |= {self._position[d] for d in self._position if d > first and d not in self._open}
        base["skip"] = sorted(p - start for p in skip)
        return base

    def _state_of_source(self) -> dict[str, Any] | None:
        state: Callable[[], dict[str, Any]] | None = getattr(self.source, "state", None)
        return dict(state()) if callable(state) else None


class RolloutWorker:
    """Keeps `num_groups_in_flight` groups of `n` episodes running. Backpressure: no new group
    starts while `max_queued` finished groups wait for the trainer, which bounds how far ahead
    (so how stale) the rollout runs. Groups a dead engine cut are run again after `heal()`, up
    to `max_reruns` times each; then they go to the trainer as they ended."""

    def __init__(
        self,
        runner: RolloutRunner,
        source: TaskSupply,
        *,
        n: int,
        num_groups_in_flight: int,
        max_queued: int,
        seed_for_group: Callable[[int], int],
        heal: Callable[[], Awaitable[int]] | None = None,
        max_reruns: int = 2,
    ) -> None:
        self.runner = runner
        self.source = source
        self.n = n
        self.num_groups_in_flight = num_groups_in_flight
        self.max_queued = max_queued
        self.seed_for_group = seed_for_group
        self.heal = heal
        self.ledger = DrawLedger(source)
        self.done: asyncio.Queue[tuple[int, Group]] = asyncio.Queue()
        self.running: set[asyncio.Task[None]] = set()
        self.num_groups_started = 0
        self.num_engine_reruns = 0
        self.num_engine_restarts = 0
        self.max_reruns = max_reruns
        self._retry: list[tuple[int, Task]] = []
        self._num_reruns: dict[int, int] = {}  # draw -> times run again
        self._changed = asyncio.Event()
        self._main: asyncio.Task[None] | None = None

    @property
    def queue_depth(self) -> int:
        """Finished groups waiting for the trainer."""
        return self.done.qsize()

    def start(self) -> None:
        self._main = asyncio.ensure_future(self._fill())

    async def _fill(self) -> None:
        while True:
            while len(self.running) < self.num_groups_in_flight and (
                self.done.qsize() < self.max_queued
            ):
                self._start_group()
            self._changed.clear()
            await self._changed.wait()

    def _start_group(self) -> None:
        draw, task = self._retry.pop(0) if self._retry else self.ledger.draw()
        seed = self.seed_for_group(self.num_groups_started)
        self.num_groups_started += 1
        job = asyncio.ensure_future(self._run(draw, task, seed))
        self.running.add(job)
        job.add_done_callback(self._finished)

    async def _run(self, draw: int, task: Task, seed: int) -> None:
        group = await self.runner.run_group(task, self.n, seed=seed)
        if is_engine_aborted(group) and self._num_reruns.get(draw, 0) < self.max_reruns:
            # infrastructure, not the policy: heal and play it again
            self._num_reruns[draw] = self._num_reruns.get(draw, 0) + 1
            self.num_engine_reruns += 1
            if self.heal is not None:
                self.num_engine_restarts += await self.heal()
            self._retry.append((draw, task))
            return
        self._num_reruns.pop(draw, None)
        self.done.put_nowait((draw, group))

    def _finished(self, job: asyncio.Task[None]) -> None:
        self.running.discard(job)
        if not job.cancelled() and job.exception() is not None:
            log.error("a rollout group failed: %r", job.exception())
        self._changed.set()

    async def take(self) -> Group:
        """The oldest finished group (waits for one); frees a queue slot for a new group."""
        if self._main is not None and self._main.done():
            self._main.result()  # the worker died: raise its error here
        draw, group = await self.done.get()
        self.ledger.taken(draw)
        self._changed.set()
        return group

    async def stop(self) -> None:
        """Cancel the worker and every group in flight (their episodes end ABORTED)."""
        jobs = [j for j in (self._main, *self.running) if j is not None]
        for job in jobs:
            job.cancel()
        for job in jobs:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await job


async def take_groups(
    worker: RolloutWorker,
    want: int,
    *,
    trainer_version: int,
    max_staleness: int | None,
    max_flat_groups: int | None,
) -> Collected:
    """`want` groups for the train step at `trainer_version`, taken as they finish; the one place
    trajectories past the staleness bound are dropped (counted; the step waits for more). With
    dynamic sampling, zero-variance groups (tied, or all failed) too, up to `max_flat_groups`."""
    out = Collected(groups=[])
    while len(out.groups) < want:
        fresh, num_stale = drop_stale([await worker.take()], trainer_version, max_staleness)
        out.num_stale_dropped += num_stale
        if max_flat_groups is not None and fresh and not filter_zero_variance_groups(fresh)[0]:
            out.dropped += fresh
            out.num_zero_variance_dropped += 1
            if len(out.dropped) >= max_flat_groups:
                break
            continue
        out.groups.extend(fresh)
    out.num_engine_reruns, worker.num_engine_reruns = worker.num_engine_reruns, 0
    out.num_engine_restarts, worker.num_engine_restarts = worker.num_engine_restarts, 0
    return out
