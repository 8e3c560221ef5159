"""The run's progress display: the phase under way (eval / rollout / train) with its count, rate
and ETA. A live rich bar on a terminal; in a log file, a plain line when a phase starts, every
`interval_s` while it runs, and when it ends — so a run shows where it is within seconds."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


def format_duration(seconds: float | None) -> str:
    """`H:MM:SS`; `-:--:--` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


@dataclass
class Phase:
    """One phase's count. Its rate is measured once a unit is done; before that, `expected_rate`
    (the last phase of the same kind's) gives the ETA, so even a one-call train phase has one."""

    name: str
    total: float
    unit: str
    expected_rate: float | None = None
    completed: float = 0.0
    start_s: float = field(default_factory=time.monotonic)
    clock: Callable[[], float] = time.monotonic
    work: Callable[[], float] | None = None
    """A finer counter that moves before the first unit is done (the engine's sampled tokens)."""
    max_work: float | None = None
    """The most `work` the phase can take (its token budget): an upper bound on the ETA."""
    work_start: float = 0.0

    def __post_init__(self) -> None:
        self.work_start = self.work() if self.work is not None else 0.0

    def advance(self, n: float = 1.0) -> None:
        self.completed += n
        self.total = max(self.total, self.completed)  # dynamic sampling may run extra rounds

    @property
    def elapsed_s(self) -> float:
        return self.clock() - self.start_s

    @property
    def rate(self) -> float | None:
        """Units per second since the phase started (episodes of a batch end together, so a
        windowed rate would jump)."""
        if self.completed > 0 and self.elapsed_s > 0:
            return self.completed / self.elapsed_s
        return self.expected_rate

    @property
    def eta_s(self) -> float | None:
        rate = self.rate
        if not rate:
            return None
        if self.completed == 0:
            return max(self.total / rate - self.elapsed_s, 0.0)
        return max(self.total - self.completed, 0.0) / rate

    @property
    def work_done(self) -> float:
        return (self.work() - self.work_start) if self.work is not None else 0.0

    def describe(self) -> str:
        """`eval 12/32 episodes · 0.41 episodes/s · ETA 0:00:49 · 2,051 tokens sampled (31/s)`;
        before the first unit ends, the ETA is the token budget's bound (`ETA ≤ 0:03:10`)."""
        rate = f"{self.rate:.3g} {self.unit}/s" if self.rate else f"-- {self.unit}/s"
        count = f"{self.completed:,.0f}/{self.total:,.0f} {self.unit}"
        line = f"{self.name} {count} · {rate} · ETA {format_duration(self.eta_s)}"
        work = self.work_done
        if self.work is None or work <= 0 or self.elapsed_s <= 0:
            return line
        work_rate = work / self.elapsed_s
        if self.eta_s is None and self.max_work:
            bound = max(self.max_work - work, 0.0) / work_rate
            line = line.replace("ETA -:--:--", f"ETA ≤ {format_duration(bound)}")
        return f"{line} · {work:,.0f} tokens sampled ({work_rate:.3g}/s)"


class RunProgress:
    """`with progress.phase("eval", total=32, unit="episodes") as phase: ... phase.advance()`.

    Live bars when the console is a terminal, plain lines otherwise.
    `note(text)` prints a message (above the bar when live); `enabled=False` shows no phases.
    `clock` times the phases (a test passes its own)."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        console: Any = None,
        interval_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from rich.console import Console

        self.console = console or Console()
        self.is_live = self.console.is_terminal
        self.enabled, self.interval_s, self._clock = enabled, interval_s, clock
        self.start_s = clock()
        self.phase_now: Phase | None = None
        self._rates: dict[str, float] = {}  # last measured rate per phase kind
        self._bar: Any = None
        self._bar_task: Any = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._last_print_s = self.start_s

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> RunProgress:
        if self.enabled and self.is_live:
            from rich.progress import BarColumn, Progress, TextColumn

            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                console=self.console,
            )
            self._bar.start()
        if self.enabled:
            self._ticker = threading.Thread(target=self._tick, name="agentrl-progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    # ------------------------------------------------------------ phases

    @contextlib.contextmanager
    def phase(
        self,
        name: str,
        total: float,
        unit: str,
        *,
        kind: str | None = None,
        work: Callable[[], float] | None = None,
        max_work: float | None = None,
    ) -> Iterator[Phase]:
        """A phase named `name` (e.g. "step 3/10 rollout"); `kind` (default `name`) keys the rate
        remembered for the next phase of its kind; `work`/`max_work`: see `Phase`."""
        kind = kind or name
        phase = Phase(
            name,
            float(total),
            unit,
            expected_rate=self._rates.get(kind),
            work=work,
            max_work=max_work,
            start_s=self._clock(),
            clock=self._clock,
        )
        self.phase_now = phase
        if self.enabled:
            self._show_start(phase)
        is_done = False
        try:
            yield phase
            is_done = True
        finally:
            if is_done and phase.completed and phase.elapsed_s > 0:
                self._rates[kind] = phase.completed / phase.elapsed_s
            self.phase_now = None
            if self.enabled:
                self._show_end(phase, is_done=is_done)

    def note(self, text: str) -> None:
        """A message for the reader, whatever `enabled` says (e.g. what an interrupt does)."""
        self._print(text)

    def _show_start(self, phase: Phase) -> None:
        if self._bar is not None:
            self._bar_task = self._bar.add_task(
                phase.name, total=phase.total or None, status=phase.describe()
            )
        else:
            self._print(phase.describe())

    def _show_end(self, phase: Phase, *, is_done: bool) -> None:
        if self._bar is not None and self._bar_task is not None:
            self._bar.remove_task(self._bar_task)
            self._bar_task = None
        if not is_done:  # interrupted: what ended (episodes cut short included) is no result
            self._print(f"{phase.name} stopped after {format_duration(phase.elapsed_s)}")
            return
        done = (
            f"{phase.name} done: {phase.completed:,.0f} {phase.unit} in "
            f"{format_duration(phase.elapsed_s)}"
        )
        if phase.rate and phase.completed:
            done += f" ({phase.rate:.3g} {phase.unit}/s)"
        self._print(done)

    def _tick(self) -> None:
        """Refresh the live bar every second; print the phase line every `interval_s` in a log."""
        while not self._stop.wait(1.0 if self._bar is not None else 0.5):
            self.tick()

    def tick(self) -> None:
        """Show the running phase now: on the bar, or as a line when `interval_s` has passed."""
        phase = self.phase_now
        if phase is None:
            return
        if self._bar is not None and self._bar_task is not None:
            self._bar.update(
                self._bar_task,
                completed=phase.completed,
                total=phase.total or None,
                status=phase.describe(),
            )
        elif self._bar is None and self._clock() - self._last_print_s >= self.interval_s:
            self._print(phase.describe())

    def _print(self, text: str) -> None:
        self._last_print_s = self._clock()
        if self.is_live:
            self.console.print(text, highlight=False, markup=False, soft_wrap=True)
        else:
            stamp = format_duration(self._clock() - self.start_s)
            self.console.print(f"[{stamp}] {text}", highlight=False, markup=False, soft_wrap=True)
        self.console.file.flush()


def sampled_tokens(engine: Any) -> Callable[[], float] | None:
    """The engine's count of sampled tokens, when it keeps one (the in-process engine does)."""
    stats = getattr(engine, "stats", None)
    if stats is None or not hasattr(stats, "num_generated_tokens"):
        return None
    return lambda: float(stats.num_generated_tokens)


def step_line(done: int, num_steps: int, metrics: dict[str, float], eta_s: float | None) -> str:
    """One line per train step: reward, EM, tied groups (and whether their compute was
    skipped), where the time went, and the run's ETA."""
    m = metrics.get
    num_groups = int(m("rollout/num_groups", 0))
    num_tied = int(m("rollout/num_zero_variance_groups", 0))
    skipped = m("train/num_zero_advantage_skipped", 0) > 0 or m("train/skipped_no_signal") == 1
    tied = f"{num_tied}/{num_groups} groups tied, no signal" + (" (skipped)" if skipped else "")
    return (
        f"step {done}/{num_steps}: reward {m('rollout/reward_mean', math.nan):.3f} · pass rate "
        f"{m('rollout/pass_rate', math.nan):.3f} · {tied} · rollout "
        f"{m('time/rollout_s', math.nan):.0f}s, train {m('time/train_s', math.nan):.0f}s · "
        f"run ETA {format_duration(eta_s)}"
    )
