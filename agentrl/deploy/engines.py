"""`EngineGroup`: the engines of a run as the runtime drives them, in SGLang's vocabulary --
generation behind the weight-update gate (`engine`), `pause_generation(mode)` /
`continue_generation()`, `release_memory()` / `resume_memory(tags)`, `heal()` -- and the weight
version the group serves. Two implementations: `InProcessEngines` (one engine object: a gated
`LocalEngine`, or a client of servers agentrl does not supervise) and `ServedEngineGroup` (the
servers of Ray actors, routed and supervised)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agentrl.config import RunConfig
from agentrl.deploy.plan import Deployment
from agentrl.engine.factory import sglang_client
from agentrl.engine.gate import GatedEngine
from agentrl.engine.router import RoutedEngine
from agentrl.engine.sglang import SGLangEngine
from agentrl.engine.sglang.launcher import ManagedProcess, start_router
from agentrl.engine.sglang.protocol import resolve_api_key
from agentrl.engine.sglang.supervisor import heal_servers

if TYPE_CHECKING:
    from agentrl.engine.base import Engine
    from agentrl.engine.sglang.launcher import SGLangCluster

log = logging.getLogger(__name__)


class EngineGroup(Protocol):
    """`memory_bytes`: what engine 0 holds now (None: it does not say); `servers`: a client per
    server, to probe what each serves; `weight_targets`: what each trainer rank sends to
    (engines or URLs); `heal`: restart dead servers, the indices restarted."""

    engine: GatedEngine  # what episodes generate with

    @property
    def weight_version(self) -> int: ...
    def set_weight_version(self, version: int) -> None: ...
    async def pause_generation(self, mode: str) -> None: ...
    async def continue_generation(self) -> None: ...
    async def release_memory(self) -> None: ...
    async def resume_memory(self, tags: list[str]) -> None: ...
    async def memory_bytes(self) -> float | None: ...
    def servers(self) -> list[Any]: ...
    def weight_targets(self, num_ranks: int, transport: str) -> list[list[Any]]: ...
    async def heal(self) -> list[int]: ...
    def servers_down(self) -> list[int]: ...
    def mark_all_up(self) -> None: ...
    async def close(self) -> None: ...


class InProcessEngines:
    """One engine object in this process: a `LocalEngine`, or a client of servers agentrl
    does not supervise (`engine.kind=http`) or launched (`engine.kind=sglang`: `launched`, which
    heals and stops them). The gate is its pause: no other client sends it requests. It stamps
    its own weight version."""

    def __init__(self, engine: Engine, *, launched: SGLangCluster | None = None) -> None:
        self.engine = GatedEngine(engine)
        self.launched = launched

    @property
    def weight_version(self) -> int:
        return self.engine.inner.weight_version

    def set_weight_version(self, version: int) -> None:
        return None  # the last bucket stamped it

    async def pause_generation(self, mode: str) -> None:
        return None

    async def continue_generation(self) -> None:
        return None

    async def release_memory(self) -> None:
        await self.engine.inner.release_memory()

    async def resume_memory(self, tags: list[str]) -> None:
        await self.engine.inner.resume_memory(tags)

    async def memory_bytes(self) -> float | None:
        return None

    def servers(self) -> list[Any]:
        return []

    def weight_targets(self, num_ranks: int, transport: str) -> list[list[Any]]:
        return [[self.engine.inner]]

    async def heal(self) -> list[int]:
        return await self.launched.heal() if self.launched is not None else []

    def servers_down(self) -> list[int]:
        return []

    def mark_all_up(self) -> None:
        return None

    async def close(self) -> None:
        await self.engine.close()
        if self.launched is not None:
            self.launched.shutdown()


class ServedEngineGroup:
    """The run's `EngineGroup` on Ray: the servers of the `EngineServer` actors, reached through
    one `RoutedEngine` (`routed`: sticky per episode, or a router; it tracks the weight version
    they serve), behind the weight-update gate for rollouts (`engine`)."""

    def __init__(
        self,
        actors: list[Any],
        urls: list[str],
        cfg: RunConfig,
        plan: Deployment,
        *,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the key the servers want (`engine_api_key`), else the config's."""
        self.actors, self.urls, self.cfg, self.plan = actors, urls, cfg, plan
        self.api_key = api_key or resolve_api_key(cfg.engine)
        # the clients' copy of the engine section carries the key; the run's config does not
        self.engine_cfg = dataclasses.replace(cfg.engine, api_key=self.api_key)
        self.num_restarts = [0] * len(actors)
        self.router_process: ManagedProcess | None = None
        if plan.use_router:
            logs = Path(cfg.checkpoint.save) / "engine_logs"
            self.router_process = start_router(
                urls, log_path=logs / "router.log", api_key=self.api_key, die_with_parent=True
            )
        client = functools.partial(sglang_client, self.engine_cfg, cfg.rollout)
        router = client(self.router_process.url) if self.router_process else None
        self.routed = RoutedEngine([client(u) for u in urls], router=router)
        self.engine = GatedEngine(self.routed)

    @classmethod
    async def start(
        cls, actors: list[Any], cfg: RunConfig, plan: Deployment, *, api_key: str | None = None
    ) -> ServedEngineGroup:
        urls = await asyncio.gather(*(a.start.remote() for a in actors))
        group = cls(actors, list(urls), cfg, plan, api_key=api_key)
        versions = {await c.get_weight_version() for c in group.routed.clients}
        if len(versions) != 1:
            raise RuntimeError(f"engine servers started with different weight versions {versions}")
        group.set_weight_version(versions.pop())
        log.info("engine group ready: %s", group.urls)
        return group

    async def memory_bytes(self) -> float | None:
        """Accelerator memory engine 0 holds, as its server reports it (SGLang: the sizes of the
        parts it has not released)."""
        from agentrl.engine.sglang.protocol import memory_bytes_from_server_info

        info = await self.routed.clients[0].get_server_info()
        return memory_bytes_from_server_info(info, self.routed.clients[0].released_tags())

    def servers(self) -> list[SGLangEngine]:
        return list(self.routed.clients)

    def weight_targets(self, num_ranks: int, transport: str) -> list[list[Any]]:
        """Tensors stay on their host: each colocated rank sends to the engines on its GPUs.
        Otherwise rank 0 reaches every engine (a broadcast group, or a directory on disk)."""
        per_rank: list[list[Any]] = [[] for _ in range(num_ranks)]
        if transport == "tensor" and self.plan.is_colocated:
            for e, url in enumerate(self.urls):
                rank = self.plan.colocated_rank(e)
                per_rank[rank if rank is not None else 0].append(url)
        else:
            per_rank[0] = list(self.urls)
        return per_rank

    async def heal(self) -> list[int]:
        """Restart every server that died (`heal_servers`, up to `cluster.max_engine_restarts`
        each, on a fresh port); returns the indices restarted."""
        alive = await asyncio.gather(*(a.is_alive.remote() for a in self.actors))
        dead = await heal_servers(
            list(alive),
            self.urls,
            self.num_restarts,
            restart=lambda i: self.actors[i].start.remote(),
            report=lambda i: self.actors[i].report.remote(),
            max_restarts=self.plan.max_engine_restarts,
            router_url=self.router_process.url if self.router_process else None,
            api_key=self.api_key,
        )
        for i in dead:
            await self.routed.clients[i].close()
            self.routed.clients[i] = sglang_client(self.engine_cfg, self.cfg.rollout, self.urls[i])
        return dead

    @property
    def weight_version(self) -> int:
        return self.routed.weight_version

    def set_weight_version(self, version: int) -> None:
        self.routed.set_weight_version(version)

    async def pause_generation(self, mode: str) -> None:
        await self.routed.pause_generation(mode)

    async def continue_generation(self) -> None:
        await self.routed.continue_generation()

    async def release_memory(self) -> None:
        await self.routed.release_memory()

    async def resume_memory(self, tags: list[str]) -> None:
        await self.routed.resume_memory(tags)

    def servers_down(self) -> list[int]:
        return self.routed.servers_down()

    def mark_all_up(self) -> None:
        self.routed.mark_all_up()

    async def close(self) -> None:
        await self.routed.close()
        if self.router_process is not None:
            self.router_process.stop()
        await asyncio.gather(*(a.stop.remote() for a in self.actors), return_exceptions=True)
