"""The router's worker API (smg and sglang-router 0.3): `POST /workers {"url"}` queues a worker,
`DELETE /workers/{id}` removes one by the id `GET /workers` lists. Both answer 202 and act in
the background, so each call waits until the listing shows the change."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from agentrl.engine.base import EngineError

_ACCEPTED = frozenset({200, 201, 202, 204})


async def list_workers(client: httpx.AsyncClient, router_url: str) -> list[dict[str, Any]]:
    response = await client.get(f"{router_url}/workers")
    _check(response, "GET", f"{router_url}/workers")
    return list(response.json().get("workers", []))


async def add_worker(
    router_url: str, url: str, *, api_key: str | None = None, timeout_s: float = 60.0
) -> None:
    """Register `url` and wait until the router lists it as healthy."""
    async with _client(api_key) as client:
        response = await client.post(f"{router_url}/workers", json={"url": url})
        _check(response, "POST", f"{router_url}/workers")
        await _wait(client, router_url, timeout_s, lambda ws: _healthy(ws, url), f"add {url}")


async def remove_worker(
    router_url: str, url: str, *, api_key: str | None = None, timeout_s: float = 60.0
) -> None:
    """Remove `url` (nothing to do when the router does not list it) and wait until it is gone."""
    async with _client(api_key) as client:
        for worker in await list_workers(client, router_url):
            if worker.get("url") == url:
                path = f"{router_url}/workers/{worker['id']}"
                _check(await client.delete(path), "DELETE", path)
        await _wait(client, router_url, timeout_s, lambda ws: not _listed(ws, url), f"remove {url}")


async def replace_worker(
    router_url: str, old_url: str, new_url: str, *, api_key: str | None = None
) -> None:
    """A restarted server (new port) takes the place of its dead predecessor."""
    await remove_worker(router_url, old_url, api_key=api_key)
    await add_worker(router_url, new_url, api_key=api_key)


def _client(api_key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return httpx.AsyncClient(timeout=30.0, headers=headers)


def _check(response: httpx.Response, method: str, url: str) -> None:
    if response.status_code not in _ACCEPTED:
        raise EngineError(
            f"router: {method} {url} -> HTTP {response.status_code}: {response.text[:300]}"
        )


def _listed(workers: list[dict[str, Any]], url: str) -> bool:
    return any(w.get("url") == url for w in workers)


def _healthy(workers: list[dict[str, Any]], url: str) -> bool:
    return any(w.get("url") == url and w.get("is_healthy", True) for w in workers)


async def _wait(
    client: httpx.AsyncClient, router_url: str, timeout_s: float, is_done: Any, what: str
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not is_done(await list_workers(client, router_url)):
        if loop.time() > deadline:
            raise EngineError(f"router at {router_url} did not {what} within {timeout_s}s")
        await asyncio.sleep(0.2)
