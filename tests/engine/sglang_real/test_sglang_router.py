"""The real sglang-router binary over loopback in front of two stand-in SGLang servers, driven
by agentrl: the router agentrl picks for what is installed, the routing key keeps an episode on
one server, and a server is removed and re-added through the router's worker API."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from agentrl.deploy.processes import choose_router, router_command
from agentrl.engine.base import SamplingParams
from agentrl.engine.sglang import SGLangEngine
from agentrl.engine.sglang.router_admin import add_worker, remove_worker
from tests.support.sglang_real import StandInServer, free_port, sglang_path


@contextlib.contextmanager
def sglang_on_path() -> Iterator[None]:
    sys.path.insert(0, str(sglang_path()))
    try:
        yield
    finally:
        sys.path.remove(str(sglang_path()))


@pytest.fixture(scope="module")
def workers(standin_factory: Callable[..., StandInServer]) -> list[StandInServer]:
    return [standin_factory(), standin_factory()]


@pytest.fixture(scope="module")
def router(workers: list[StandInServer], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The router agentrl would start, as its own process."""
    with sglang_on_path():
        importlib.invalidate_caches()
        choice = choose_router("consistent_hashing")
    port = free_port()
    cmd = router_command([w.url for w in workers], host="127.0.0.1", port=port,
                         policy=choice.policy, module=choice.module)  # fmt: skip
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    env = dict(os.environ, PYTHONPATH=str(sglang_path()))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _is_up(url, len(workers)):
            assert proc.poll() is None, f"router exited: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"router not up: {log_path.read_text()[-3000:]}"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)
        if proc.poll() is None:
            proc.kill()


def _is_up(url: str, num_workers: int) -> bool:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        response = httpx.get(f"{url}/workers", timeout=5)
        return (
            response.status_code == 200 and len(response.json().get("workers", [])) == num_workers
        )
    return False


def served(workers: list[StandInServer]) -> list[int]:
    return [w.state()["num_cached_sequences"] for w in workers]


async def test_the_routing_key_keeps_an_episode_on_one_server(
    router: str, workers: list[StandInServer]
) -> None:
    engine = SGLangEngine(router)
    for key in ("episode-a", "episode-b", "episode-c"):
        before = served(workers)
        for turn in range(4):
            await engine.generate([turn + 1, 2], SamplingParams(max_new_tokens=1), routing_key=key)
        grown = [after - b for after, b in zip(served(workers), before, strict=True)]
        assert sorted(grown) == [0, 4], (key, grown)  # every turn on the same server
    await engine.close()


async def test_a_server_removed_and_added_back(router: str, workers: list[StandInServer]) -> None:
    engine = SGLangEngine(router)
    before = served(workers)
    await engine.generate([5], SamplingParams(max_new_tokens=1), routing_key="episode-d")
    home = next(i for i, (a, b) in enumerate(zip(served(workers), before, strict=True)) if a > b)
    await remove_worker(router, workers[home].url, timeout_s=30)
    listed = httpx.get(f"{router}/workers", timeout=10).json()["workers"]
    assert [w["url"] for w in listed] == [workers[1 - home].url]
    before = served(workers)
    await engine.generate([6], SamplingParams(max_new_tokens=1), routing_key="episode-d")
    assert served(workers)[1 - home] == before[1 - home] + 1  # the episode moved over
    await add_worker(router, workers[home].url, timeout_s=60)
    listed = httpx.get(f"{router}/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in listed) == sorted(w.url for w in workers)
    await engine.close()


def test_the_old_worker_routes_are_gone(router: str) -> None:
    """agentrl's router calls use `/workers`; the routes it used to call answer 404."""
    response = httpx.post(f"{router}/add_worker", params={"url": "http://127.0.0.1:9"}, timeout=10)
    assert response.status_code == 404
