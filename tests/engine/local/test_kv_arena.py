"""KVArena: slots are taken and given back without moving data; never-written rows read as 0."""

from __future__ import annotations

import pytest
import torch

from agentrl.engine.local.kv_arena import KVArena


def make_arena(num_slots: int = 3) -> KVArena:
    arena = KVArena(
        num_layers=2, num_kv_heads=2, head_dim=4, num_slots=num_slots, max_len=8,
        dtype=torch.float32,
    )  # fmt: skip
    arena.allocate("cpu")
    return arena


def test_slots_are_handed_out_until_none_is_free_and_come_back() -> None:
    arena = make_arena()
    taken = [arena.take() for _ in range(3)]
    assert sorted(taken) == [0, 1, 2] and arena.take() is None
    arena.give_back(taken[1])
    assert arena.num_free == 1 and arena.take() == taken[1]
    assert arena.keys[0].shape == (4 * 8, 2, 4)  # 3 slots + the scratch slot
    assert arena.offset(2) == 16 and arena.scratch_slot == 3


def test_giving_back_a_free_slot_is_an_error() -> None:
    arena = make_arena()
    with pytest.raises(ValueError, match="slot 1 is not a taken slot"):
        arena.give_back(1)


def test_ensure_clean_zeroes_only_unwritten_rows() -> None:
    arena = make_arena()
    slot = arena.take()
    assert slot is not None
    arena.ensure_clean(slot, 3)
    arena.keys[0][arena.offset(slot) : arena.offset(slot) + 3] = 5.0  # a step wrote 3 tokens
    arena.ensure_clean(slot, 6)
    rows = arena.keys[0][arena.offset(slot) : arena.offset(slot) + 6]
    assert (rows[:3] == 5.0).all() and (rows[3:] == 0.0).all()


def test_free_buffers_releases_memory_and_frees_every_slot() -> None:
    arena = make_arena()
    arena.take()
    arena.free_buffers()
    assert not arena.is_allocated and arena.num_free == 3
    arena.allocate("cpu")
    assert arena.is_allocated


def test_cuda_sizing_leaves_the_trainers_reserve_out(monkeypatch) -> None:
    """Colocated: the arena is sized from the free memory less what the trainer will still
    allocate; a reserve that leaves no room is refused naming both numbers."""
    from types import SimpleNamespace

    from agentrl.engine.local import kv_arena

    config = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=2)  # fmt: skip
    per_token = KVArena.bytes_per_token(2, 2, 16, torch.bfloat16)
    monkeypatch.setattr(kv_arena, "_free_cuda_bytes", lambda device: 101 * 100 * per_token)

    def slots(reserve: int) -> int:
        return KVArena.for_model(config, torch.bfloat16, "cuda:0", max_batch_size=1000,
                                 max_context_len=100, num_slots=None, mem_fraction=1.0,
                                 reserve_bytes=reserve).num_slots  # fmt: skip

    assert slots(0) == 100  # 101 sequences' worth free, one kept as scratch
    assert slots(50 * 100 * per_token) == 50
    with pytest.raises(ValueError, match="kept for the trainer"):
        slots(101 * 100 * per_token)
