"""`EngineGroup`: the engines of a run as the runtime drives them, in SGLang's vocabulary --
generation behind the weight-update gate (`engine`), `pause_generation(mode)` /
`continue_generation()`, `release_memory()` / `resume_memory(tags)`, `heal()` -- and the weight
version the group serves. Two implementations: `InProcessEngines` (one engine object: a gated
`LocalEngine`, or a client of servers agentrl does not supervise) and `ServedEngineGroup` (the
servers agentrl launched -- subprocesses or Ray actors -- routed, and healed and stopped by their
`ServerSupervisor`)."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Protocol

from agentrl.config import EngineConfig, RolloutConfig
from agentrl.deploy.plan import Deployment
from agentrl.deploy.supervisor import ServerSupervisor
from agentrl.engine.factory import sglang_client
from agentrl.engine.gate import GatedEngine
from agentrl.engine.router import RoutedEngine
from agentrl.engine.sglang import SGLangEngine

if TYPE_CHECKING:
    from agentrl.engine.base import Engine

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
    """One engine object in this process: a `LocalEngine`, or a client of servers agentrl does
    not supervise (`engine.kind=http`). The gate is its pause: no other client sends it requests.
    It stamps its own weight version."""

    def __init__(self, engine: Engine) -> None:
        self.engine = GatedEngine(engine)

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
        return []

    def servers_down(self) -> list[int]:
        return []

    def mark_all_up(self) -> None:
        return None

    async def close(self) -> None:
        await self.engine.close()


class ServedEngineGroup:
    """The run's `EngineGroup` over the servers agentrl launched: reached through one
    `RoutedEngine` (`routed`: sticky per episode, or the router; it tracks the weight version
    they serve), behind the weight-update gate for rollouts (`engine`); `supervisor` heals and
    stops them. `engine_cfg` carries the servers' key."""

    def __init__(
        self,
        supervisor: ServerSupervisor,
        engine_cfg: EngineConfig,
        rollout: RolloutConfig,
        plan: Deployment,
    ) -> None:
        self.supervisor = supervisor
        self.plan = plan
        # a dropped connection is explained by the server that died, with its log
        self._client = functools.partial(
            sglang_client, engine_cfg, rollout, failure_report=supervisor.failure_report
        )
        router_url = supervisor.router_url
        router = self._client(router_url) if router_url else None
        self.routed = RoutedEngine([self._client(u) for u in supervisor.urls], router=router)
        self.engine = GatedEngine(self.routed)

    @classmethod
    async def start(
        cls,
        supervisor: ServerSupervisor,
        engine_cfg: EngineConfig,
        rollout: RolloutConfig,
        plan: Deployment,
    ) -> ServedEngineGroup:
        """The servers started (stopped again if the group cannot use them) and their group."""
        await supervisor.start()
        try:
            group = cls(supervisor, engine_cfg, rollout, plan)
            versions = {await c.get_weight_version() for c in group.routed.clients}
            if len(versions) != 1:
                raise RuntimeError(
                    f"engine servers started with different weight versions {versions}"
                )
        except BaseException:
            await supervisor.stop()
            raise
        group.set_weight_version(versions.pop())
        log.info("engine group ready: %s", group.urls)
        return group

    @property
    def urls(self) -> list[str]:
        return self.supervisor.urls

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
        """Restart every server that died (the supervisor: up to `cluster.max_engine_restarts`
        each); a fresh client for each. Returns the indices restarted."""
        dead = await self.supervisor.heal()
        for i in dead:
            await self.routed.clients[i].close()
            self.routed.clients[i] = self._client(self.urls[i])
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
        await self.supervisor.stop()
