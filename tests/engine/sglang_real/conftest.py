"""The SGLang conformance suite's fixtures: SGLang's own server (tests/engine/sglang_real/harness.py)
as a process on a free loopback port, one per test module. Every test here skips, with the reason,
when `AGENTRL_SGLANG_PATH` is unset (scripts/ci_sglang.sh sets it, once per pinned version)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.sglang_real import SKIP_REASON, sglang_path

REPO_ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if sglang_path() is not None:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@dataclass
class StandInServer:
    """One harness process: SGLang's app, the stand-in scheduler, its log."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def state(self) -> dict:
        return httpx.get(f"{self.url}/_standin/state", timeout=10).json()

    def hold(self, is_held: bool) -> None:
        httpx.post(f"{self.url}/_standin/hold", json={"is_held": is_held}, timeout=10)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Requests admitted meanwhile stay in flight (no step runs) until the block ends."""
        self.hold(True)
        try:
            yield
        finally:
            self.hold(False)

    async def wait_until(
        self, is_done: Callable[[dict], bool], what: str, timeout_s: float = 30.0
    ) -> dict:
        """Poll the stand-in's state until `is_done`, letting the test's own requests run
        meanwhile (bounded: a hang fails naming `what`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with httpx.AsyncClient(timeout=10) as client:
            while loop.time() < deadline:
                state = (await client.get(f"{self.url}/_standin/state")).json()
                if is_done(state):
                    return state
                await asyncio.sleep(0.05)
        raise AssertionError(f"stand-in SGLang: {what} not reached in {timeout_s}s: {self.state()}")

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def free_port() -> int:
    from agentrl.engine.sglang.launcher import free_ports

    return free_ports(1)[0]


def start_standin(
    model_path: str, log_dir: Path, *extra_args: str, timeout_s: float = 180.0
) -> StandInServer:
    """The harness on a free port with SGLang's command line; returns once `/health` answers."""
    port = free_port()
    log_path = log_dir / f"sglang-standin-{port}.log"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    )
    cmd = [sys.executable, "-m", "tests.engine.sglang_real.harness", "--model-path", model_path,
           "--host", "127.0.0.1", "--port", str(port), *extra_args]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    server = StandInServer(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.is_alive():
            raise RuntimeError(f"the SGLang stand-in exited at start:\n{server.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(
        f"the SGLang stand-in did not answer /health in {timeout_s}s:\n{server.log()}"
    )


@pytest.fixture(scope="module")
def standin_factory(
    smollm2_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., StandInServer]]:
    """Start stand-in servers (SGLang flags as arguments); all stop when the module ends."""
    servers: list[StandInServer] = []
    log_dir = tmp_path_factory.mktemp("sglang_standin")

    def start(*extra_args: str) -> StandInServer:
        server = start_standin(smollm2_path, log_dir, *extra_args)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def sglang_server(standin_factory: Callable[..., StandInServer]) -> StandInServer:
    """One stand-in SGLang server (TP 1) for the module."""
    return standin_factory()
