"""Multi-turn prefix reuse: between turns an episode's routing key keeps its KV-arena slot and the
tokens whose K/V that slot holds; least-recently-used idle slots are evicted under pressure."""

from __future__ import annotations

import collections


class PrefixCache:
    """Idle slots by routing key, oldest first. A slot is here only while no request uses it."""

    def __init__(self) -> None:
        self._idle: collections.OrderedDict[str, tuple[int, list[int]]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._idle)

    def take(self, key: str) -> tuple[int, list[int]] | None:
        """The key's idle slot and the token ids its K/V hold, now owned by the caller."""
        return self._idle.pop(key, None)

    def put(self, key: str, slot: int, token_ids: list[int]) -> int | None:
        """Keep `slot` idle for `key`. Returns a slot this displaced (the caller frees it)."""
        old = self._idle.pop(key, None)
        self._idle[key] = (slot, token_ids)
        return old[0] if old is not None else None

    def evict_oldest(self) -> int | None:
        """Forget the least recently used key; returns its slot for reuse, or None when empty."""
        if not self._idle:
            return None
        _, (slot, _) = self._idle.popitem(last=False)
        return slot

    def clear(self) -> list[int]:
        """Forget every key (weights changed, memory released); returns their slots."""
        slots = [slot for slot, _ in self._idle.values()]
        self._idle.clear()
        return slots


def num_reusable(cached_ids: list[int], input_ids: list[int]) -> int:
    """How many leading tokens of `input_ids` the cached K/V cover. At least one input token is
    always left to prefill: the model must run on it to give the next token's logits."""
    limit = min(len(cached_ids), len(input_ids) - 1)
    n = 0
    while n < limit and cached_ids[n] == input_ids[n]:
        n += 1
    return n
