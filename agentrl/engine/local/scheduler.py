"""The scheduler of `LocalEngine`: which sequences wait and which run, and the KV-arena slot each
running one holds: admission into free slots under a prefill-token budget, multi-turn prefix reuse
by routing key, and giving slots back (or keeping them for the key's next turn) as sequences end.
"""

from __future__ import annotations

import collections

from agentrl.engine.local.batching import Sequence
from agentrl.engine.local.kv_arena import KVArena
from agentrl.engine.local.prefix_cache import PrefixCache, num_reusable


class Scheduler:
    """Waiting and running sequences over one arena. Only the engine's worker thread calls it,
    except `add`, which the event loop calls (a deque append is atomic)."""

    def __init__(
        self,
        arena: KVArena,
        *,
        max_batch_size: int,
        max_prefill_tokens: int,
        use_prefix_cache: bool,
    ) -> None:
        self.arena = arena
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.use_prefix_cache = use_prefix_cache
        self.pending: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.prefixes = PrefixCache()

    def add(self, seq: Sequence) -> None:
        self.pending.append(seq)

    def has_work(self) -> bool:
        return bool(self.pending or self.running)

    def schedule(self) -> list[Sequence]:
        """Drop cancelled sequences, admit waiting ones while a slot, batch room and prefill
        budget remain, and return the batch for the next step."""
        self.retire(cancelled_only=True)
        budget = self.max_prefill_tokens
        while self.pending and len(self.running) < self.max_batch_size and budget > 0:
            seq = self.pending[0]
            if not seq.is_cancelled and not self._assign_slot(seq):
                break  # no slot free: wait for a running sequence to finish
            self.pending.popleft()
            if not seq.is_cancelled:
                self.running.append(seq)
                budget -= seq.num_tokens - seq.num_cached
        return list(self.running)

    def retire(self, *, cancelled_only: bool = False) -> list[Sequence]:
        """Take finished (unless `cancelled_only`) and cancelled sequences out of the running
        batch, keeping their slots for their routing keys. Returns the finished ones."""
        finished = []
        still = []
        for seq in self.running:
            if seq.is_cancelled or (seq.is_finished and not cancelled_only):
                self.release_slot(seq, keep=True)
                if not seq.is_cancelled:
                    finished.append(seq)
            else:
                still.append(seq)
        self.running = still
        return finished

    def take_all(self, *, keep_prefixes: bool) -> list[Sequence]:
        """Every running and waiting sequence, now out of the scheduler (abort, failure, close)."""
        taken = self.running + list(self.pending)
        self.running = []
        self.pending = collections.deque()
        for seq in taken:
            self.release_slot(seq, keep=keep_prefixes)
        return taken

    def preempt_all(self, *, free_buffers: bool = True) -> None:
        """The arena's memory is about to go (freed, or paused): running sequences wait again, to
        be prefilled anew (prompt and output so far); kept prefixes are forgotten."""
        for seq in self.running:
            seq.slot = None
            seq.num_cached = 0
        self.pending.extendleft(reversed(self.running))
        self.running = []
        self.prefixes.clear()
        if free_buffers:
            self.arena.free_buffers()
        else:
            self.arena.free_all_slots()

    def drop_prefixes(self) -> None:
        """Forget every kept prefix (their K/V came from weights that just changed)."""
        for slot in self.prefixes.clear():
            self.arena.give_back(slot)

    def release_slot(self, seq: Sequence, *, keep: bool) -> None:
        """Give the slot back, or keep it idle under the routing key for the episode's next turn."""
        if seq.slot is None:
            return
        slot, seq.slot = seq.slot, None
        if keep and self.use_prefix_cache and seq.routing_key is not None and seq.num_cached:
            slot = self.prefixes.put(seq.routing_key, slot, seq.token_ids[: seq.num_cached])
        if slot is not None:
            self.arena.give_back(slot)

    def _assign_slot(self, seq: Sequence) -> bool:
        key = seq.routing_key if self.use_prefix_cache else None
        if key is not None and (hit := self.prefixes.take(key)) is not None:
            seq.slot, cached_ids = hit
            seq.num_cached = num_reusable(cached_ids, seq.token_ids)
            if not seq.output_ids:
                seq.num_reused = seq.num_cached
            return True
        slot = self.arena.take()
        if slot is None:
            slot = self.prefixes.evict_oldest()
        if slot is None:
            return False
        seq.slot = slot
        seq.num_cached = 0
        return True
