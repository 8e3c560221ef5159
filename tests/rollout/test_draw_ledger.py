"""DrawLedger: a fully-async run's checkpoint re-runs the tasks in flight, never the trained ones."""

from __future__ import annotations

from agentrl.data import TaskSource
from agentrl.rollout.async_worker import DrawLedger
from agentrl.types import Task

TASKS = [Task(id=str(i), data={"q": i}) for i in range(6)]
ORDER = [t.id for t in TaskSource(TASKS, seed=2).next_batch(12)]


def resumed_from(state: dict) -> TaskSource:
    source = TaskSource(TASKS, seed=0)
    source.load_state(state)
    return source


def test_state_reruns_open_draws_and_skips_the_ones_taken_out_of_order() -> None:
    ledger = DrawLedger(TaskSource(TASKS, seed=2))
    draws = [ledger.draw() for _ in range(5)]
    assert [task.id for _, task in draws] == ORDER[:5]
    ledger.taken(draws[1][0])  # groups finish out of order; 0, 2 and 4 are still running
    ledger.taken(draws[3][0])
    source = resumed_from(ledger.state())
    assert [t.id for t in source.next_batch(4)] == [ORDER[0], ORDER[2], ORDER[4], ORDER[5]]


def test_a_resumed_run_keeps_the_earlier_skips_in_its_own_checkpoints() -> None:
    ledger = DrawLedger(TaskSource(TASKS, seed=2))
    draws = [ledger.draw() for _ in range(4)]
    ledger.taken(draws[1][0])
    ledger.taken(draws[3][0])
    second = DrawLedger(resumed_from(ledger.state()))
    again = [second.draw() for _ in range(2)]
    assert [task.id for _, task in again] == [ORDER[0], ORDER[2]]
    second.taken(again[1][0])  # ORDER[0] still in flight at the second checkpoint
    source = resumed_from(second.state())
    assert [t.id for t in source.next_batch(3)] == [ORDER[0], ORDER[4], ORDER[5]]


def test_with_nothing_in_flight_the_state_is_the_sources() -> None:
    source = TaskSource(TASKS, seed=2)
    ledger = DrawLedger(source)
    for draw, _ in [ledger.draw() for _ in range(3)]:
        ledger.taken(draw)
    assert ledger.state() == source.state()
