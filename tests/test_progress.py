"""The run's progress display in a log file (no terminal): plain lines with the phase, its
count, rate and ETA, at the phase's start, periodically, and at its end. The tests move their own
clock (no sleeps)."""

from __future__ import annotations

import io
import re

from rich.console import Console

from agentrl.progress import Phase, RunProgress, format_duration


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


def test_before_the_first_episode_ends_the_token_budget_bounds_the_eta() -> None:
    tokens, clock = [0.0], Clock()
    phase = Phase(
        "eval", total=4, unit="episodes", work=lambda: tokens[0], max_work=1000,
        start_s=clock.now - 10, clock=clock,
    )  # fmt: skip
    assert phase.describe() == "eval 0/4 episodes · -- episodes/s · ETA -:--:--"
    tokens[0] = 200.0  # 20 tokens/s over 10 s: the 800 left take at most 40 s
    assert phase.describe() == (
        "eval 0/4 episodes · -- episodes/s · ETA ≤ 0:00:40 · 200 tokens sampled (20/s)"
    )


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
