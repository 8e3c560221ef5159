"""`RoutedEngine`: one `Engine` over several SGLang-API servers, each episode pinned to one server
by consistent hashing of its routing key (all turns reach the server that holds its prefix), the
way sglang-router's `consistent_hashing` policy spreads `X-SMG-Routing-Key`."""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from agentrl.engine.base import Completion, EngineUnavailable, SamplingParams

if TYPE_CHECKING:
    import torch

    from agentrl.engine.sglang import SGLangEngine


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with virtual nodes: removing a server moves only its own keys."""

    def __init__(self, num_servers: int, *, num_virtual_nodes: int = 160) -> None:
        points = sorted(
            (_hash(f"server-{s}#{v}"), s)
            for s in range(num_servers)
            for v in range(num_virtual_nodes)
        )
        self._hashes = [h for h, _ in points]
        self._servers = [s for _, s in points]

    def lookup(self, key: str, is_up: Sequence[bool]) -> int | None:
        """The first server clockwise of `key` that is up (None when every server is down)."""
        start = bisect.bisect(self._hashes, _hash(key))
        for i in range(len(self._hashes)):
            server = self._servers[(start + i) % len(self._hashes)]
            if is_up[server]:
                return server
        return None


class RoutedEngine:
    """Generation goes to one server per routing key; control calls (weights, memory, abort) go
    to every server. A server that cannot be reached, or answers with a weight version other than
    the policy's (it was restarted), is marked down: its episodes end ABORTED/engine and new keys
    go to the next server on the ring until `mark_all_up` after it is healed and synced."""

    def __init__(
        self,
        clients: Sequence[SGLangEngine],
        *,
        weight_version: int = 0,
        router: SGLangEngine | None = None,
    ) -> None:
        """`router`: an sglang-router in front of the same servers; generation then goes through
        it (it hashes the routing-key header itself) and control calls still go to each server."""
        if not clients:
            raise ValueError("RoutedEngine needs at least one server client")
        self.clients = list(clients)
        self.router = router
        self.ring = HashRing(len(self.clients))
        self.is_up = [True] * len(self.clients)
        self.weight_version = weight_version
        self._round_robin = itertools.cycle(range(len(self.clients)))

    def set_weight_version(self, version: int) -> None:
        """What every server serves after a sync: answers stamped otherwise are stale."""
        self.weight_version = version

    def server_for(self, routing_key: str | None) -> int:
        if routing_key is None:
            for _ in self.clients:
                index = next(self._round_robin)
                if self.is_up[index]:
                    return index
            index = None
        else:
            index = self.ring.lookup(routing_key, self.is_up)
        if index is None:
            raise EngineUnavailable(
                f"every engine server is down ({[c.base_url for c in self.clients]})"
            )
        return index

    def mark_down(self, index: int) -> None:
        self.is_up[index] = False

    def servers_down(self) -> list[int]:
        return [i for i, up in enumerate(self.is_up) if not up]

    def mark_all_up(self) -> None:
        """Every server is healed and synced: new keys hash to their own servers again."""
        self.is_up[:] = [True] * len(self.is_up)

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, routing_key: str | None = None
    ) -> Completion:
        if self.router is not None:
            index = -1
            client = self.router
        else:
            index = self.server_for(routing_key)
            client = self.clients[index]
        try:
            completion = await client.generate(input_ids, sampling, routing_key=routing_key)
            if index < 0:  # sglang_router does not say which worker answered
                completion.served_by = ""
        except EngineUnavailable:
            if index >= 0:
                self.mark_down(index)
            raise
        if completion.weight_version != self.weight_version:
            if index >= 0:
                self.mark_down(index)
            raise EngineUnavailable(
                f"{client.base_url} serves weight version "
                f"{completion.weight_version}, the policy is at {self.weight_version} "
                "(restarted without a sync)"
            )
        return completion

    async def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return list(
            await asyncio.gather(*(getattr(c, method)(*args, **kwargs) for c in self.clients))
        )

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, weight_version: int
    ) -> None:
        named = list(named_tensors)
        await self._all("update_weights", named, weight_version=weight_version)
        self.weight_version = weight_version

    async def release_memory(self) -> None:
        await self._all("release_memory")

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        await self._all("resume_memory", tags)

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._all("pause_generation", mode)

    async def continue_generation(self) -> None:
        await self._all("continue_generation")

    async def abort(self) -> None:
        await self._all("abort")

    async def health(self) -> bool:
        return all(await self._all("health"))

    async def close(self) -> None:
        await self._all("close")
        if self.router is not None:
            await self.router.close()
