"""The router agentrl starts (`choose_router`: smg with consistent_hashing, else sglang-router
with manual) as its real binary over loopback, in front of two stand-in workers: an episode's
routing key stays on one worker, and a worker is removed and added again through the worker API
(`POST /workers`, `DELETE /workers/{id}`; the old `/add_worker` routes answer 404).

Finds the router packages where AGENTRL_SGLANG_PATH (sglang-router, beside SGLang) and
AGENTRL_SMG_PATH point, or installed; skips those it cannot find."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentrl.engine.base import SamplingParams
from agentrl.engine.sglang import SGLangEngine
from agentrl.engine.sglang.launcher import (
    ManagedProcess,
    free_ports,
    router_command,
    start_router,
    wait_healthy,
)
from agentrl.engine.sglang.router_admin import add_worker, list_workers, remove_worker
from agentrl.engine.sglang.supervisor import heal_servers
from tests.engine.sglang_client.standin import StandIn

pytestmark = pytest.mark.slow
PATHS = [
    p for p in (os.environ.get("AGENTRL_SMG_PATH"), os.environ.get("AGENTRL_SGLANG_PATH")) if p
]


def _router_path(module: str) -> str | None:
    """The directory to put on PYTHONPATH for `module` ("" = installed), or None."""
    for path in PATHS:
        if (Path(path) / module).is_dir():
            return path
    return "" if importlib.util.find_spec(module) is not None else None


@pytest.fixture
def workers() -> Iterator[list[StandIn]]:
    standins = [StandIn().start(), StandIn().start()]
    yield standins
    for standin in standins:
        standin.stop()


@pytest.mark.parametrize(("module", "policy"), [("smg", "consistent_hashing"),
                                                ("sglang_router", "manual")])  # fmt: skip
async def test_the_routing_key_is_sticky_and_a_worker_is_replaced(
    module: str, policy: str, workers: list[StandIn], tmp_path: Path
) -> None:
    path = _router_path(module)
    if path is None:
        pytest.skip(f"{module} is not installed (set AGENTRL_SGLANG_PATH / AGENTRL_SMG_PATH)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*PATHS, *sys.path])}
    (port,) = free_ports(1)
    urls = [w.url for w in workers]
    cmd = router_command(urls, host="127.0.0.1", port=port, policy=policy, module=module)
    router = ManagedProcess("router", f"http://127.0.0.1:{port}", cmd, tmp_path / "r.log", env)
    router.start()
    engine = SGLangEngine(router.url, max_retries=0)
    try:
        wait_healthy(router, timeout_s=60, path="/health")
        for _ in range(4):  # every turn of one episode on one worker
            await engine.generate([1, 2], SamplingParams(max_new_tokens=1), routing_key="ep-1")
        counts = [len(w.bodies("/generate")) for w in workers]
        assert sorted(counts) == [0, 4], counts
        old = httpx.post(f"{router.url}/add_worker", params={"url": urls[0]}, timeout=10)
        assert old.status_code == 404  # what agentrl called before

        await remove_worker(router.url, urls[0])
        async with httpx.AsyncClient() as client:
            assert [w["url"] for w in await list_workers(client, router.url)] == [urls[1]]
        before = len(workers[1].bodies("/generate"))
        for i in range(3):
            await engine.generate([1], SamplingParams(max_new_tokens=1), routing_key=f"k{i}")
        assert len(workers[1].bodies("/generate")) == before + 3

        await add_worker(router.url, urls[0])
        async with httpx.AsyncClient() as client:
            assert sorted(w["url"] for w in await list_workers(client, router.url)) == sorted(urls)
    finally:
        await engine.close()
        router.stop()


async def test_a_healed_worker_takes_its_place_in_the_router_start_router_made(
    workers: list[StandIn], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one supervisor (`heal_servers`) with the one router starter: the dead worker's
    restart, on a new port, replaces it in the router; the live one is left alone."""
    path = _router_path("smg") or _router_path("sglang_router")
    if path is None:
        pytest.skip("no router package (set AGENTRL_SMG_PATH / AGENTRL_SGLANG_PATH)")
    if path:
        monkeypatch.syspath_prepend(path)  # choose_router looks in this process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*PATHS, *sys.path])}
    urls = [w.url for w in workers]
    router = start_router(urls, log_path=tmp_path / "r.log", env=env)
    replacement = StandIn().start()

    async def restart(i: int) -> str:
        return replacement.url

    async def report(i: int) -> str:
        return "exited with code 9"

    try:
        workers[0].stop()
        num_restarts = [0, 0]
        healed = await heal_servers([False, True], urls, num_restarts, restart=restart,
                                    report=report, max_restarts=1, router_url=router.url)  # fmt: skip
        assert healed == [0] and num_restarts == [1, 0]
        assert urls == [replacement.url, workers[1].url]
        async with httpx.AsyncClient() as client:
            assert sorted(w["url"] for w in await list_workers(client, router.url)) == sorted(urls)
        with pytest.raises(RuntimeError, match="engine 0 .*limit 1.*exited with code 9"):
            await heal_servers([False, True], urls, num_restarts, restart=restart, report=report,
                               max_restarts=1, router_url=router.url)  # fmt: skip
    finally:
        replacement.stop()
        router.stop()
