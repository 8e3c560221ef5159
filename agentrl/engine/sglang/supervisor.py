"""`heal_servers`: the one supervisor of launched inference servers -- whether agentrl started them
in this process (`SGLangCluster`) or from Ray actors (`cluster.ServedEngineGroup`). Run between
steps by the run's `EngineGroup.heal`: a dead server is reported once, restarted (up to a limit,
past it the run stops with its last log lines), and takes its old place in the router."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from agentrl.engine.sglang.router_admin import replace_worker

log = logging.getLogger(__name__)


async def heal_servers(
    alive: list[bool],
    urls: list[str],
    num_restarts: list[int],
    *,
    restart: Callable[[int], Awaitable[str]],
    report: Callable[[int], Awaitable[str]],
    max_restarts: int,
    router_url: str | None = None,
    api_key: str | None = None,
) -> list[int]:
    """Restart server `i` for every `alive[i]` False (`restart(i)`: its new URL, healthy) and
    return those indices; they serve the launch weights until the caller syncs them. `urls` and
    `num_restarts` are updated in place. A server past `max_restarts` raises RuntimeError with
    `report(i)` (its log's tail) instead."""
    dead = [i for i, ok in enumerate(alive) if not ok]
    for i in dead:
        if num_restarts[i] >= max_restarts:
            raise RuntimeError(
                f"engine {i} at {urls[i]} died after {num_restarts[i]} restarts (limit "
                f"{max_restarts}); {await report(i)}"
            )
        num_restarts[i] += 1
        log.warning("engine %d at %s died; restarting (%d/%d): %s", i, urls[i], num_restarts[i],
                    max_restarts, await report(i))  # fmt: skip
    new_urls = await asyncio.gather(*(restart(i) for i in dead))
    for i, url in zip(dead, new_urls, strict=True):
        if router_url is not None:
            await replace_worker(router_url, urls[i], url, api_key=api_key)
        urls[i] = url
    return dead
