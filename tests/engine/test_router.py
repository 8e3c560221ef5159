"""RoutedEngine: one server per routing key (consistent hashing), failover when a server dies,
and a restarted server's stale weights caught by the weight version."""

from __future__ import annotations

import pytest

from agentrl.engine.base import Completion, EngineUnavailable, FinishReason, SamplingParams
from agentrl.engine.router import HashRing, RoutedEngine


class Server:
    """Stands in for one SGLang-API client: the test is about routing, not HTTP."""

    def __init__(self, name: str, version: int = 0) -> None:
        self.base_url, self.version, self.keys, self.is_dead = name, version, [], False

    async def generate(self, input_ids, sampling, *, routing_key=None):
        if self.is_dead:
            raise EngineUnavailable(f"{self.base_url} refused the connection")
        self.keys.append(routing_key)
        return Completion([1], [-0.5], FinishReason.STOP, self.version, served_by=self.base_url)


def test_ring_moves_only_the_removed_servers_keys():
    ring = HashRing(4)
    keys = [f"episode-{i}" for i in range(400)]
    before = {k: ring.lookup(k, [True] * 4) for k in keys}
    after = {k: ring.lookup(k, [True, True, False, True]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == 2 for k in moved)
    assert all(after[k] != 2 for k in keys)
    assert len(set(before.values())) == 4  # every server gets keys


async def test_every_turn_of_an_episode_reaches_one_server():
    servers = [Server("a"), Server("b")]
    engine = RoutedEngine(servers)
    for _turn in range(3):
        for episode in range(20):
            await engine.generate([1, 2], SamplingParams(), routing_key=f"ep{episode}")
    for server in servers:
        for key in set(server.keys):
            assert server.keys.count(key) == 3
    assert not set(servers[0].keys) & set(servers[1].keys)
    assert servers[0].keys and servers[1].keys


async def test_a_dead_server_is_marked_down_and_its_keys_fail_over():
    servers = [Server("a"), Server("b")]
    engine = RoutedEngine(servers)
    key = next(k for k in (f"ep{i}" for i in range(100)) if engine.server_for(k) == 0)
    servers[0].is_dead = True
    with pytest.raises(EngineUnavailable):
        await engine.generate([1], SamplingParams(), routing_key=key)
    assert engine.is_up == [False, True]
    await engine.generate([1], SamplingParams(), routing_key=key)
    assert servers[1].keys == [key]


async def test_a_server_on_other_weights_is_refused():
    servers = [Server("a", version=3), Server("b", version=0)]  # b restarted
    engine = RoutedEngine(servers, weight_version=3)
    key = next(k for k in (f"ep{i}" for i in range(100)) if engine.server_for(k) == 1)
    with pytest.raises(EngineUnavailable, match="weight version 0.* at 3"):
        await engine.generate([1], SamplingParams(), routing_key=key)
    assert engine.is_up == [True, False]


async def test_all_servers_down_is_unavailable():
    engine = RoutedEngine([Server("a")])
    engine.mark_down(0)
    with pytest.raises(EngineUnavailable, match="every engine server is down"):
        await engine.generate([1], SamplingParams(), routing_key="k")


async def test_served_by_names_the_server_and_not_a_router():
    """Trajectories record the server of each turn; behind sglang_router the worker is unknown,
    so it is left empty rather than naming the router as if it were one engine."""
    servers = [Server("http://a"), Server("http://b")]
    direct = await RoutedEngine(servers).generate([1], SamplingParams(), routing_key="ep1")
    assert direct.served_by in {"http://a", "http://b"}
    routed = RoutedEngine(servers, router=Server("http://router"))  # type: ignore[arg-type]
    assert (await routed.generate([1], SamplingParams(), routing_key="ep1")).served_by == ""
