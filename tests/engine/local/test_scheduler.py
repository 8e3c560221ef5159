"""Scheduler: admission into free slots under the batch and prefill budgets, prefix reuse by
routing key, preemption when the arena is dropped."""

from __future__ import annotations

import asyncio

import torch

from agentrl.engine.base import FinishReason, SamplingParams
from agentrl.engine.local.batching import Sequence
from agentrl.engine.local.kv_arena import KVArena
from agentrl.engine.local.scheduler import Scheduler


def make_scheduler(num_slots: int = 4, **kwargs: int) -> Scheduler:
    arena = KVArena(
        num_layers=1, num_kv_heads=1, head_dim=2, num_slots=num_slots, max_len=64,
        dtype=torch.float32,
    )  # fmt: skip
    arena.allocate("cpu")
    options = {"max_batch_size": 8, "max_prefill_tokens": 1000, **kwargs}
    return Scheduler(arena, use_prefix_cache=True, **options)


def make_seq(n: int, key: str | None = None) -> Sequence:
    loop = asyncio.new_event_loop()
    return Sequence(list(range(n)), SamplingParams(), loop.create_future(), loop, 0, key)


def test_admits_while_slots_batch_room_and_prefill_budget_last() -> None:
    scheduler = make_scheduler(num_slots=3, max_batch_size=8, max_prefill_tokens=25)
    for n in (10, 10, 10, 10):
        scheduler.add(make_seq(n))
    assert len(scheduler.schedule()) == 3  # the budget runs out after the third prompt
    scheduler = make_scheduler(num_slots=2)
    for n in (5, 5, 5):
        scheduler.add(make_seq(n))
    assert len(scheduler.schedule()) == 2 and len(scheduler.pending) == 1  # no third slot


def test_a_finished_turn_keeps_its_slot_for_the_next_one() -> None:
    scheduler = make_scheduler()
    first = make_seq(6, key="episode")
    scheduler.add(first)
    (running,) = scheduler.schedule()
    running.output_ids, running.num_cached = [7, 8], 7  # prompt + the first output were fed
    running.finish(FinishReason.STOP)
    slot = running.slot
    assert scheduler.retire() == [first] and running.slot is None
    follow_up = make_seq(0, key="episode")
    follow_up.prompt_ids = first.prompt_ids + [7, 8, 9]
    scheduler.add(follow_up)
    scheduler.schedule()
    assert (follow_up.slot, follow_up.num_cached, follow_up.num_reused) == (slot, 7, 7)


def test_preempt_all_requeues_running_sequences_first_without_their_cache() -> None:
    scheduler = make_scheduler()
    running, waiting = make_seq(4), make_seq(4)
    scheduler.add(running)
    scheduler.schedule()
    running.output_ids, running.num_cached = [1], 4
    scheduler.add(waiting)
    scheduler.preempt_all()
    assert list(scheduler.pending) == [running, waiting]
    assert (running.slot, running.num_cached) == (None, 0)
    assert not scheduler.arena.is_allocated
