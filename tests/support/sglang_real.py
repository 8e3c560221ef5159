"""SGLang's real code on a CPU machine, for the conformance suite (tests/engine/sglang_real):
where it is installed (`AGENTRL_SGLANG_PATH`, filled by scripts/ci_sglang.sh), how to import it,
and its server (the suite's harness) as a process on a free loopback port."""

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
from types import ModuleType
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
SGLANG_PATH_ENV = "AGENTRL_SGLANG_PATH"
SKIP_REASON = (
    f"{SGLANG_PATH_ENV} is unset: the SGLang conformance suite runs against SGLang's real code "
    "installed by `bash scripts/ci_sglang.sh` (one directory per pinned version)"
)


def sglang_path() -> str | None:
    """The directory that holds an installed SGLang (and its pure-Python needs), or None."""
    path = os.environ.get(SGLANG_PATH_ENV)
    if not path:
        return None
    if not (Path(path) / "sglang").is_dir():
        raise RuntimeError(
            f"{SGLANG_PATH_ENV}={path!r} holds no sglang package; run "
            "`bash scripts/ci_sglang.sh VERSION` to install one there"
        )
    return path


def _declare_torchvision_ops() -> None:
    """PyPI's torchvision is a CUDA build whose C library cannot load against CPU torch, but its
    Python part still registers fake kernels for `nms` and `qnms` at import, which needs the two
    ops declared. Declare them (schemas only, as torchvision's C library would), nothing more."""
    import torch

    if hasattr(_declare_torchvision_ops, "library"):
        return
    try:
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:  # a real torchvision C library is loaded: it declared them already
        return
    _declare_torchvision_ops.library = library  # type: ignore[attr-defined]  # keeps them alive


def import_sglang() -> ModuleType:
    """`sglang` from `AGENTRL_SGLANG_PATH` (put at the front of sys.path)."""
    path = sglang_path()
    if path is None:
        raise RuntimeError(SKIP_REASON)
    if path not in sys.path:
        sys.path.insert(0, path)
    _declare_torchvision_ops()
    import sglang

    return sglang


def sglang_version() -> str:
    from importlib.metadata import PathDistribution

    path = sglang_path()
    assert path is not None, SKIP_REASON
    (info,) = Path(path).glob("sglang-*.dist-info")
    return PathDistribution(info).version


def version_tuple(version: str) -> tuple[int, ...]:
    """'0.5.15.post1' -> (0, 5, 15): releases compare by their numeric parts."""
    return tuple(int(part) for part in version.split(".")[:3])


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


MAX_SGLANG_PORT = 55535
"""SGLang 0.5.15 derives a gRPC port of --port + 10000 and refuses to start above 65535."""


def free_port() -> int:
    """A free loopback port every supported SGLang accepts as its --port."""
    from agentrl.deploy.processes import free_ports

    for _ in range(200):  # most of Linux's ephemeral range (32768-60999) is below the limit
        (port,) = free_ports(1)
        if port <= MAX_SGLANG_PORT:
            return port
    raise RuntimeError(f"no free port at or below {MAX_SGLANG_PORT} in 200 tries")


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


# ---------------------------------------------------------------- weights the suite sends


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Three tensors, float32 and bfloat16 (two flattened buckets), named after `seed`."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [
        (f"layers.{seed}.w", torch.randn(3, 4, generator=gen)),
        (f"layers.{seed}.b", torch.randn(4, generator=gen)),
        (f"layers.{seed}.norm", torch.randn(5, generator=gen).to(torch.bfloat16)),
    ]


def assert_loaded(state: dict, named: list[tuple[str, torch.Tensor]]) -> None:
    """The stand-in's model holds every tensor of `named`, bit for bit."""
    for name, tensor in named:
        got = state["weights"][name]
        assert got["dtype"] == str(tensor.dtype) and got["shape"] == list(tensor.shape)
        assert got["values"] == tensor.flatten().tolist(), name  # bit-exact
