"""PrefixCache: idle slots by routing key, least recently used evicted first."""

from __future__ import annotations

from agentrl.engine.local.prefix_cache import PrefixCache, num_reusable


def test_take_returns_the_slot_and_its_tokens_once() -> None:
    cache = PrefixCache()
    assert cache.put("a", 3, [1, 2, 3]) is None
    assert cache.take("a") == (3, [1, 2, 3])
    assert cache.take("a") is None


def test_evicts_least_recently_stored_and_put_displaces_a_keys_old_slot() -> None:
    cache = PrefixCache()
    cache.put("a", 0, [1])
    cache.put("b", 1, [2])
    assert cache.put("a", 2, [1, 1]) == 0  # the caller frees slot 0
    assert cache.evict_oldest() == 1  # b is now the oldest
    assert cache.clear() == [2] and len(cache) == 0 and cache.evict_oldest() is None


def test_num_reusable_stops_at_the_first_difference_and_leaves_one_token() -> None:
    assert num_reusable([1, 2, 3, 4], [1, 2, 9, 4, 5]) == 2
    assert num_reusable([1, 2, 3], [1, 2, 3]) == 2
    assert num_reusable([1, 2], [1, 2, 3, 4]) == 2
    assert num_reusable([], [5]) == 0
