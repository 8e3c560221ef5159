"""`ServerSupervisor`: the one supervisor of the inference servers agentrl launches -- it starts N
servers and their router, heals them between steps (a dead one is reported once and restarted, up
to a limit; past it the run stops with its last log lines) and stops them. Where a server runs is
its `ServerExecutor`'s business: a subprocess of this process, or one of a Ray actor
(`agentrl.deploy.servers`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agentrl.deploy.processes import (
    ManagedProcess,
    choose_router,
    free_ports,
    keyed_env,
    router_command,
    wait_healthy,
)
from agentrl.engine.sglang.router_admin import replace_worker

log = logging.getLogger(__name__)
ROUTER_START_TIMEOUT_S = 120.0


class ServerExecutor(Protocol):
    """Where one server runs. `start`: (re)start it and wait until it serves; its URL."""

    async def start(self) -> str: ...
    async def is_alive(self) -> bool: ...
    async def report(self) -> str: ...
    async def stop(self) -> None: ...


@dataclass(frozen=True)
class RouterOptions:
    """A router in front of the servers, started in this process. `port` 0: a free one; `env`:
    its environment (None: this process's)."""

    log_path: Path
    policy: str
    port: int = 0
    env: dict[str, str] | None = None


class ServerSupervisor:
    """`servers`, each restarted at most `max_restarts` times; `router` (None: none) is restarted
    on its port when it dies (never, when `max_restarts` is 0). `urls`: where each server listens
    now (a restart may move it); `router_url`: where generation goes through the router."""

    def __init__(
        self,
        servers: Sequence[ServerExecutor],
        *,
        max_restarts: int,
        router: RouterOptions | None = None,
        api_key: str | None = None,
    ) -> None:
        self.servers = list(servers)
        self.max_restarts = max_restarts
        self.router_options = router
        self.api_key = api_key
        self.urls: list[str] = []
        self.num_restarts = [0] * len(servers)
        self.router: ManagedProcess | None = None

    @property
    def router_url(self) -> str | None:
        return self.router.url if self.router is not None else None

    async def start(self) -> list[str]:
        """Every server healthy, then the router over them; everything stopped if one fails."""
        try:
            self.urls = list(await asyncio.gather(*(s.start() for s in self.servers)))
            if self.router_options is not None:
                self._start_router(self.router_options)
        except BaseException:
            await self.stop()
            raise
        return self.urls

    async def heal(self) -> list[int]:
        """Restart the router if it died, then every dead server; the indices of the servers
        restarted (they serve the launch weights until the caller syncs them)."""
        if self.router is not None and not self.router.is_alive():
            if not self.max_restarts:
                raise RuntimeError(f"the router died; {self.router.report()}")
            log.warning("restarting the router: %s", self.router.report())
            await asyncio.to_thread(self._restart_router)
        alive = await asyncio.gather(*(s.is_alive() for s in self.servers))
        dead = [i for i, ok in enumerate(alive) if not ok]
        for i in dead:
            if self.num_restarts[i] >= self.max_restarts:
                raise RuntimeError(
                    f"engine {i} at {self.urls[i]} died after {self.num_restarts[i]} restarts "
                    f"(limit {self.max_restarts}); {await self.servers[i].report()}"
                )
            self.num_restarts[i] += 1
            count = f"{self.num_restarts[i]}/{self.max_restarts}"
            report = await self.servers[i].report()
            log.warning("engine %d at %s died; restarting (%s): %s", i, self.urls[i], count, report)
        new_urls = await asyncio.gather(*(self.servers[i].start() for i in dead))
        for i, url in zip(dead, new_urls, strict=True):
            if self.router is not None:
                await replace_worker(self.router.url, self.urls[i], url, api_key=self.api_key)
            self.urls[i] = url
        return dead

    def _start_router(self, opts: RouterOptions) -> None:
        """The router (`choose_router`) over the servers, on 127.0.0.1; it dies with the thread
        that starts it, which lives as long as the run."""
        choice = choose_router(opts.policy)
        port = opts.port or free_ports(1)[0]
        cmd = router_command(
            self.urls,
            host="127.0.0.1",
            port=port,
            policy=choice.policy,
            module=choice.module,
            api_key=self.api_key,
        )
        env = keyed_env(opts.env, self.api_key)
        url = f"http://127.0.0.1:{port}"
        self.router = ManagedProcess(
            "sglang-router", url, cmd, opts.log_path, env, die_with_parent=True
        )
        self._restart_router()

    def _restart_router(self) -> None:
        assert self.router is not None
        self.router.stop()
        self.router.start()
        wait_healthy(self.router, timeout_s=ROUTER_START_TIMEOUT_S, path="/health")

    async def failure_report(self) -> str | None:
        """How a dead server or the router exited, with its last log lines (None while all
        run): what explains a client's connection errors."""
        for server in self.servers:
            if not await server.is_alive():
                return await server.report()
        if self.router is not None and not self.router.is_alive():
            return self.router.report()
        return None

    async def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        await asyncio.gather(*(s.stop() for s in self.servers), return_exceptions=True)
