"""The run's progress display in a log file (no terminal): plain lines with the phase, its
count, rate and ETA, at the phase's start, periodically, and at its end. The tests move their own
clock (no sleeps)."""

from __future__ import annotations

import io
import logging
import re
import sys
import warnings

import pytest
from rich.console import Console

from agentrl.progress import (
    MIN_UNITS_FOR_ETA,
    ConsoleLogHandler,
    Phase,
    RunProgress,
    format_duration,
    single_phase,
    step_line,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _log_display(clock: Clock, interval_s: float = 0.2) -> tuple[RunProgress, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    return RunProgress(console=console, interval_s=interval_s, clock=clock), out


def test_log_lines_name_the_phase_with_rate_and_eta_from_the_start() -> None:
    clock = Clock()
    progress, out = _log_display(clock)
    with progress, progress.phase("eval", total=10, unit="episodes") as phase:
        first = out.getvalue()
        phase.advance(4)
        clock.now += 1.0
        progress.tick()  # what the ticker does: the running phase, once interval_s has passed
    lines = out.getvalue().splitlines()
    # the phase shows at once, before any episode ends
    assert re.fullmatch(r"\[0:00:00\] eval 0/10 episodes · -- episodes/s · ETA -:--:--\n", first)
    running = [x for x in lines if "eval 4/10 episodes" in x]
    assert running, lines
    assert running[-1] == "[0:00:01] eval 4/10 episodes · 4 episodes/s · ETA 0:00:02"
    assert lines[-1] == "[0:00:01] eval done: 4 episodes in 0:00:01 (4 episodes/s)"


def test_a_phase_without_progress_takes_its_eta_from_the_last_one_of_its_kind() -> None:
    clock = Clock()
    progress, out = _log_display(clock)
    with progress:
        with progress.phase("step 1/3 train", total=100, unit="tokens", kind="train") as p:
            clock.now += 0.4
            p.advance(100)  # one call does the whole phase
        with progress.phase("step 2/3 train", total=200, unit="tokens", kind="train") as p:
            started = out.getvalue().splitlines()[-1]
            p.advance(200)
    # 250 tokens/s measured on step 1: step 2's 200 tokens should take 0.8 s
    assert started.endswith("step 2/3 train 0/200 tokens · 250 tokens/s · ETA 0:00:01")


def test_phase_eta_and_durations() -> None:
    clock = Clock()
    phase = Phase("rollout", total=20, unit="episodes", start_s=clock.now - 10, clock=clock)
    phase.advance(5)  # 0.5 episodes/s: 15 left take 30 s
    assert phase.rate == 0.5 and phase.eta_s == 30
    assert format_duration(3725) == "1:02:05" and format_duration(None) == "-:--:--"


def test_disabled_display_shows_no_phases_but_keeps_notes() -> None:
    out = io.StringIO()
    progress = RunProgress(enabled=False, console=Console(file=out, force_terminal=False))
    with progress, progress.phase("eval", total=3, unit="episodes") as phase:
        phase.advance()
        progress.note("SIGTERM: finishing the current step…")
    assert out.getvalue().splitlines() == ["[0:00:00] SIGTERM: finishing the current step…"]


def test_no_eta_before_a_few_units_end_only_the_tokens_sampled() -> None:
    """Issue 39: an eval of 53 s showed "ETA ≤ 2:08:15" from its token budget."""
    tokens, clock = [0.0], Clock()
    start_s = clock.now - 10

    def work() -> float:
        return tokens[0]

    phase = Phase("eval", 40, "episodes", start_s=start_s, clock=clock, work=work, max_work=1000)
    tokens[0] = 200.0
    phase.advance(MIN_UNITS_FOR_ETA - 1)
    assert phase.describe() == (
        "eval 2/40 episodes · 0.2 episodes/s · ETA -:--:-- · 200/1,000 tokens sampled (20/s)"
    )
    phase.advance()  # 3 in 10 s: the 37 left take 123 s
    assert "ETA 0:02:03" in phase.describe()


def test_the_live_bar_names_its_phase_once() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=150, color_system=None)
    progress = RunProgress(console=console, clock=Clock())
    with progress, progress.phase("eval", total=10, unit="episodes") as phase:
        phase.advance(4)
        progress.tick()
    frames = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "\n", out.getvalue()).splitlines()
    bars = [x for x in frames if "episodes/s" in x and "done" not in x]
    assert bars and all(x.count("eval") == 1 for x in bars), bars


def test_log_records_print_above_the_live_bar_and_the_handler_comes_back() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=150, color_system=None)
    terminal = logging.StreamHandler(sys.stderr)  # what logging.basicConfig installs
    root = logging.getLogger()
    root.addHandler(terminal)
    try:
        with RunProgress(console=console, clock=Clock()):
            assert terminal not in root.handlers
            logging.getLogger("agentrl.test").warning("engine slow")
        assert terminal in root.handlers
        assert not any(isinstance(h, ConsoleLogHandler) for h in root.handlers)
    finally:
        root.removeHandler(terminal)
    assert "WARNING agentrl.test: engine slow" in out.getvalue()


def test_a_repeated_warning_prints_once_logged_or_warned() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    # a library's own logger: not transformers', which stops propagating to the root once any
    # test has run a command (the CLI configures transformers' logging)
    library = logging.getLogger("some_library.models")
    progress, _ = _log_display(Clock())
    try:
        with progress:
            for _ in range(3):
                library.warning("`old_kwarg` is deprecated")
                with warnings.catch_warnings():  # what resets Python's own once-per-place memory
                    warnings.simplefilter("default")
                    warnings.warn("old argument", FutureWarning, stacklevel=1)
        logging.getLogger("agentrl.test").warning("after the run")
    finally:
        root.removeHandler(handler)
    text = stream.getvalue()
    assert text.count("old_kwarg") == 1 and text.count("FutureWarning: old argument") == 1, text
    assert "after the run" in text and not handler.filters


def test_a_load_says_what_loads_and_how_long_it_took() -> None:
    clock = Clock()
    progress, out = _log_display(clock)
    with progress, progress.loading("checkpoint runs/x/step_000003"):
        clock.now += 27
    assert out.getvalue().splitlines() == [
        "[0:00:00] loading checkpoint runs/x/step_000003…",
        "[0:00:27] loaded checkpoint runs/x/step_000003 in 0:00:27",
    ]


def test_a_single_phase_shows_like_train_and_eval_when_piped() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with single_phase("rollout", total=2, unit="episodes", console=console) as phase:
        phase.advance()
        phase.detail = "mean reward 0.50"
        phase.advance()
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("rollout 0/2 episodes · -- episodes/s · ETA -:--:--")
    assert "rollout done: 2 episodes in" in lines[-1]


def test_an_interrupted_phase_says_it_stopped_not_done() -> None:
    progress, out = _log_display(Clock())
    try:
        with progress, progress.phase("eval", total=3, unit="episodes") as phase:
            phase.advance(3)  # episodes cut short by the interrupt still end
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    last = out.getvalue().splitlines()[-1]
    assert last.endswith("eval stopped after 0:00:00") and "done" not in last


@pytest.mark.parametrize(
    ("num_tied", "expected"),
    [
        (0, "reward spread in 8/8 groups ·"),
        (3, "reward spread in 5/8 groups (3 tied: each of their episodes scored the same) ·"),
        (8, "reward spread in 0/8 groups (8 tied: each of their episodes scored the same) ·"),
    ],
)
def test_the_step_line_says_how_many_groups_had_something_to_learn(num_tied, expected) -> None:
    """It said "0/1 groups tied, no signal", which reads as if the step had no signal."""
    metrics = {"rollout/num_groups": 8.0, "rollout/num_zero_variance_groups": float(num_tied)}
    line = step_line(1, 2, metrics, eta_s=None)
    assert expected in line and "no signal" not in line
