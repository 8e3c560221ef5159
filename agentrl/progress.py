"""The run's progress display: the phase under way (eval / rollout / train) with its count, rate
and ETA. A live rich bar on a terminal; in a log file, a plain line when a phase starts, every
`interval_s` while it runs, and when it ends — so a run shows where it is within seconds. While it
shows, log records and Python warnings print above the bar, each warning's text once."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


def format_duration(seconds: float | None) -> str:
    """`H:MM:SS`; `-:--:--` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


# A first episode or two say little about the rest (they end together, or early): an eval of
# 53 s showed "ETA ≤ 2:08:15" from its token budget before any ended (issue 39).
MIN_UNITS_FOR_ETA = 3


@dataclass
class Phase:
    """One phase's count. Its ETA comes from its own rate once `MIN_UNITS_FOR_ETA` units are
    done; before that from `expected_rate` (the last phase of the same kind's), so even a
    one-call train phase has one, else it is unknown."""

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
    """The most `work` the phase can take (its token budget), shown beside the work done."""
    work_start: float = 0.0
    detail: str = ""
    """A caller's running summary, shown last (e.g. `mean reward 0.41`)."""

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
        windowed rate would jump); before any unit is done, `expected_rate`."""
        if self.completed > 0 and self.elapsed_s > 0:
            return self.completed / self.elapsed_s
        return self.expected_rate

    @property
    def eta_s(self) -> float | None:
        if self.completed >= MIN_UNITS_FOR_ETA and self.elapsed_s > 0:
            return max(self.total - self.completed, 0.0) / (self.completed / self.elapsed_s)
        if self.expected_rate:
            return max(self.total / self.expected_rate - self.elapsed_s, 0.0)
        return None

    @property
    def work_done(self) -> float:
        return (self.work() - self.work_start) if self.work is not None else 0.0

    def describe(self, *, with_name: bool = True) -> str:
        """`eval 12/32 episodes · 0.41 episodes/s · ETA 0:00:49 · 2,051/16,384 tokens sampled
        (31/s)`; the live bar shows it `with_name=False`, beside the name in its own column."""
        rate = f"{self.rate:.3g} {self.unit}/s" if self.rate else f"-- {self.unit}/s"
        count = f"{self.completed:,.0f}/{self.total:,.0f} {self.unit}"
        parts = [count, rate, f"ETA {format_duration(self.eta_s)}"]
        work = self.work_done
        if self.work is not None and work > 0 and self.elapsed_s > 0:
            budget = f"/{self.max_work:,.0f}" if self.max_work else ""
            parts.append(f"{work:,.0f}{budget} tokens sampled ({work / self.elapsed_s:.3g}/s)")
        if self.detail:
            parts.append(self.detail)
        line = " · ".join(parts)
        return f"{self.name} {line}" if with_name else line


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
        self.enabled = enabled
        self.interval_s = interval_s
        self._clock = clock
        self.start_s = clock()
        self.phase_now: Phase | None = None
        self._rates: dict[str, float] = {}  # last measured rate per phase kind
        self._bar: Any = None
        self._bar_task: Any = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._last_print_s = self.start_s
        self._logs = LogRouting(self.console, is_live=self.is_live)

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> RunProgress:
        if self.enabled:
            self._logs.start()  # before the bar: it swaps sys.stderr for a proxy of its own
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
        self._logs.stop()

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

    @contextlib.contextmanager
    def loading(self, what: str) -> Iterator[None]:
        """`loading {what}…` while it loads (a pulsing bar when live), then `loaded {what} in
        0:00:27`: a checkpoint load of half a minute shows it is not stuck."""
        start_s = self._clock()
        task = None
        if self.enabled and self._bar is not None:
            task = self._bar.add_task(f"loading {what}…", total=None, status="")
        elif self.enabled:
            self._print(f"loading {what}…")
        try:
            yield
        finally:
            if task is not None and self._bar is not None:
                self._bar.remove_task(task)
            if self.enabled:
                self._print(f"loaded {what} in {format_duration(self._clock() - start_s)}")

    def _show_start(self, phase: Phase) -> None:
        if self._bar is not None:  # the name has its own column: the status line goes without it
            self._bar_task = self._bar.add_task(
                phase.name, total=phase.total or None, status=phase.describe(with_name=False)
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
                status=phase.describe(with_name=False),
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


@contextlib.contextmanager
def single_phase(
    name: str,
    total: float,
    unit: str,
    *,
    console: Any = None,
    work: Callable[[], float] | None = None,
    max_work: float | None = None,
) -> Iterator[Phase]:
    """A command's one phase, shown as train and eval show theirs (a live bar on a terminal, a
    line every 15 s when piped): `agentrl rollout`'s episodes. `phase.advance()` per unit;
    `phase.detail` for a running summary."""
    progress = RunProgress(console=console)
    with progress, progress.phase(name, total, unit, work=work, max_work=max_work) as phase:
        yield phase


LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"  # the command line's basicConfig's


class LogRouting:
    """While a display shows: log records print through its console, above a live bar (a handler
    that holds the terminal's stream writes across it), each warning's text once (transformers
    repeated `past_key_values is deprecated` every step), Python warnings logged with them."""

    LOGGERS = ("", "transformers")  # the root and transformers' own (it does not propagate)

    def __init__(self, console: Any, *, is_live: bool) -> None:
        self.console = console
        self.is_live = is_live
        self._undo: list[Callable[[], None]] = []

    def start(self) -> None:
        showwarning = warnings.showwarning
        logging.captureWarnings(True)
        if warnings.showwarning is not showwarning:  # it was not captured before
            self._undo.append(lambda: logging.captureWarnings(False))
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                self._route(logger, handler)
        root = logging.getLogger()
        if not root.handlers:  # Python's last resort prints every warning, across a live bar
            plain = logging.StreamHandler()  # stderr, as the last resort's
            plain.setFormatter(logging.Formatter(LOG_FORMAT))
            self._add(root, ConsoleLogHandler(self.console) if self.is_live else plain)

    def stop(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _route(self, logger: logging.Logger, handler: logging.Handler) -> None:
        if not (self.is_live and _writes_to_terminal(handler)):
            once = OnceFilter()
            handler.addFilter(once)
            self._undo.append(lambda: handler.removeFilter(once))
            return
        routed = ConsoleLogHandler(self.console, handler.level, handler.formatter)
        for kept in handler.filters:
            routed.addFilter(kept)
        logger.removeHandler(handler)
        self._undo.append(lambda: logger.addHandler(handler))
        self._add(logger, routed)

    def _add(self, logger: logging.Logger, handler: logging.Handler) -> None:
        handler.addFilter(OnceFilter())
        logger.addHandler(handler)
        self._undo.append(lambda: logger.removeHandler(handler))


class ConsoleLogHandler(logging.Handler):
    """Prints log records through a rich console: above its live bar, never across it."""

    def __init__(
        self, console: Any, level: int = logging.WARNING, formatter: logging.Formatter | None = None
    ) -> None:
        super().__init__(level)
        self.console = console
        self.setFormatter(formatter or logging.Formatter(LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        except Exception:  # logging's contract: a handler never raises into the caller
            self.handleError(record)


class OnceFilter(logging.Filter):
    """Passes each warning's text once (every other level always)."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        text = record.getMessage()
        with self._lock:
            is_new = text not in self._seen
            self._seen.add(text)
        return is_new


def _writes_to_terminal(handler: logging.Handler) -> bool:
    """A stream handler on stdout or stderr (a file handler keeps its file)."""
    if not isinstance(handler, logging.StreamHandler) or isinstance(handler, logging.FileHandler):
        return False
    return handler.stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)


def step_line(done: int, num_steps: int, metrics: dict[str, float], eta_s: float | None) -> str:
    """One line per train step: reward, EM, the groups whose rewards differ (the others tied,
    and whether their compute was skipped), where the time went, and the run's ETA."""
    m = metrics.get
    num_groups = int(m("rollout/num_groups", 0))
    num_tied = int(m("rollout/num_zero_variance_groups", 0))
    skipped = m("train/num_zero_advantage_skipped", 0) > 0 or m("train/skipped_no_signal") == 1
    tied = f"reward spread in {num_groups - num_tied}/{num_groups} groups"
    if num_tied:
        how = ", skipped" if skipped else ""
        tied += f" ({num_tied} tied: each of their episodes scored the same{how})"
    return (
        f"step {done}/{num_steps}: reward {m('rollout/reward_mean', math.nan):.3f} · pass rate "
        f"{m('rollout/pass_rate', math.nan):.3f} · {tied} · rollout "
        f"{m('time/rollout_s', math.nan):.0f}s, train {m('time/train_s', math.nan):.0f}s · "
        f"run ETA {format_duration(eta_s)}"
    )
