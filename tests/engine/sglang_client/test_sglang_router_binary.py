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

from agentrl.deploy.processes import ManagedProcess, free_ports, router_command, wait_healthy
from agentrl.deploy.supervisor import RouterOptions, ServerSupervisor
from agentrl.engine.base import SamplingParams
from agentrl.engine.sglang import SGLangEngine
from agentrl.engine.sglang.router_admin import add_worker, list_workers, remove_worker
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


class Worker:
    """A `ServerExecutor` over stand-ins: each start a fresh one, on a new port."""

    def __init__(self, first: StandIn) -> None:
        self.standins = [first]
        self.is_dead = False

    def kill(self) -> None:
        self.standins[-1].stop()
        self.is_dead = True

    async def start(self) -> str:
        if self.is_dead:
            self.standins.append(StandIn().start())
            self.is_dead = False
        return self.standins[-1].url

    async def is_alive(self) -> bool:
        return not self.is_dead

    async def report(self) -> str:
        return "exited with code 9"

    async def stop(self) -> None:
        for standin in self.standins:
            standin.stop()


async def test_a_healed_worker_takes_its_place_in_the_router_the_supervisor_started(
    workers: list[StandIn], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one supervisor with the one router starter: the dead worker's restart, on a new
    port, replaces it in the router; the live one is left alone; past the limit, the run stops."""
    path = _router_path("smg") or _router_path("sglang_router")
    if path is None:
        pytest.skip("no router package (set AGENTRL_SMG_PATH / AGENTRL_SGLANG_PATH)")
    if path:
        monkeypatch.syspath_prepend(path)  # choose_router looks in this process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*PATHS, *sys.path])}
    router = RouterOptions(tmp_path / "r.log", "consistent_hashing", env=env)
    executors = [Worker(w) for w in workers]
    supervisor = ServerSupervisor(executors, max_restarts=1, router=router)
    try:
        urls = list(await supervisor.start())
        assert supervisor.router_url is not None
        executors[0].kill()
        assert await supervisor.heal() == [0] and supervisor.num_restarts == [1, 0]
        replacement = executors[0].standins[-1]
        assert supervisor.urls == [replacement.url, urls[1]] and replacement.url != urls[0]
        async with httpx.AsyncClient() as client:
            listed = await list_workers(client, supervisor.router_url)
        assert sorted(w["url"] for w in listed) == sorted(supervisor.urls)
        executors[0].kill()
        with pytest.raises(RuntimeError, match="engine 0 .*limit 1.*exited with code 9"):
            await supervisor.heal()
    finally:
        await supervisor.stop()  # the stand-ins of the fixture too: a second stop is harmless
