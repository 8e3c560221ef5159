"""One server or router process: its command line (`python -m sglang.launch_server`; a router,
`smg` else `sglang_router`), started in its own session, health-waited, stopped with its tree
(`ManagedProcess`); free ports. The one module that needs the `sglang` extra.

Flags follow SGLang's ServerArgs (`--model-path --port --tp-size --mem-fraction-static
--base-gpu-id --enable-memory-saver --api-key`) and the routers' launch_router (`--worker-urls
--policy --host --port --api-key`).

An API key never goes on a command line, where every local user reads it in `ps`: neither SGLang
(0.5.15-0.5.23 read no variable for it) nor the routers read one from the environment, so a
keyed process is started as `python -m agentrl.deploy.processes MODULE ARGS` with the key
in `AGENTRL_API_KEY` (`keyed_env`), and `main` below adds `--api-key` to MODULE's argv inside
the process (`/proc/PID/environ` is readable by the owner alone).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from agentrl.engine.base import EngineError
from agentrl.engine.sglang.protocol import API_KEY_ENV

if TYPE_CHECKING:
    from agentrl.config import EngineConfig

SGLANG_MISSING = (
    "engine.kind=sglang launches SGLang servers, but the `{module}` package is not installed. "
    "Install the extra on a CUDA machine: pip install 'agentrl[sglang]'. Without a GPU, run "
    "`agentrl serve --model PATH` and use --set engine.kind=http --set engine.url=http://127.0.0.1:30000."
)


class SGLangNotInstalled(RuntimeError):
    """The `sglang` extra (or `sglang_router`) is missing."""


def require_module(module: str, *, hint: str | None = None) -> None:
    if importlib.util.find_spec(module) is None:
        raise SGLangNotInstalled(SGLANG_MISSING.format(module=hint or module))


KEYED_LAUNCHER = "agentrl.deploy.processes"
"""Run as `python -m`: `main` starts a module with `--api-key $AGENTRL_API_KEY` added."""


def module_command(module: str, args: list[str], *, is_keyed: bool) -> list[str]:
    """`python -m module args`; keyed, through `KEYED_LAUNCHER` (the key from `keyed_env`)."""
    prefix = ["-m", KEYED_LAUNCHER, module] if is_keyed else ["-m", module]
    return [sys.executable, *prefix, *args]


def keyed_env(env: dict[str, str] | None, api_key: str | None) -> dict[str, str] | None:
    """`env` (None: this process's) with the key where `main` reads it; unchanged without one."""
    if not api_key:
        return env
    return {**(os.environ if env is None else env), API_KEY_ENV: api_key}


def main(argv: list[str]) -> None:
    """`python -m agentrl.deploy.processes MODULE ARGS...`: run MODULE as `python -m`
    would, its argv ARGS plus `--api-key` from AGENTRL_API_KEY (last: it wins over any other)."""
    module, *args = argv
    key = os.environ.get(API_KEY_ENV)
    if not key:
        raise SystemExit(f"{KEYED_LAUNCHER}: {API_KEY_ENV} is unset; it carries {module}'s key")
    sys.argv = [module, *args, "--api-key", key]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def server_command(
    model_path: str,
    engine: EngineConfig,
    *,
    host: str,
    port: int,
    tp_size: int,
    base_gpu_id: int = 0,
    enable_memory_saver: bool = False,
    api_key: str | None = None,
) -> list[str]:
    """`engine`: its KV fraction and SGLang's own flags (`sglang_args`, last). `enable_memory_saver`:
    a server sharing its GPUs with the trainer (colocated) -- without it SGLang's release/resume
    of memory silently frees nothing. `api_key`: the server wants one; the key itself goes in
    the process's environment (`keyed_env`), not in this command."""
    args = [
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp_size),
        "--mem-fraction-static",
        str(engine.mem_fraction_static),
    ]
    if base_gpu_id:
        args += ["--base-gpu-id", str(base_gpu_id)]  # servers on one host take disjoint GPUs
    if enable_memory_saver:
        args.append("--enable-memory-saver")
    args += list(engine.sglang_args)
    return module_command("sglang.launch_server", args, is_keyed=bool(api_key))


@dataclass(frozen=True)
class RouterChoice:
    """Which router package runs, and the policy it is asked for."""

    module: str  # "smg" or "sglang_router"
    policy: str


def choose_router(policy: str = "consistent_hashing") -> RouterChoice:
    """`smg` when installed (it has `consistent_hashing`, which hashes the X-SMG-Routing-Key
    header so every turn of an episode reaches the server holding its prefix); else
    sglang-router, whose CLI refuses `consistent_hashing`: there `manual` (same header, sticky
    assignment) stands in for it."""
    if importlib.util.find_spec("smg") is not None:
        return RouterChoice("smg", policy)
    require_module("sglang_router", hint="smg (or sglang_router)")
    return RouterChoice("sglang_router", "manual" if policy == "consistent_hashing" else policy)


def router_command(
    worker_urls: list[str],
    *,
    host: str,
    port: int,
    policy: str,
    module: str = "smg",
    api_key: str | None = None,
) -> list[str]:
    """`api_key`: the router sends one to the workers (their --api-key); the key itself goes in
    the process's environment (`keyed_env`). Its Prometheus server binds where the router
    binds, on a free port: by default both routers put it on 0.0.0.0:29000 (every interface,
    and a second router on the machine fails to start)."""
    (metrics_port,) = free_ports(1, host)
    args = [
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--host",
        host,
        "--port",
        str(port),
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
    ]
    return module_command(f"{module}.launch_router", args, is_keyed=bool(api_key))


@dataclass
class ManagedProcess:
    """One child process (server or router) with its log file; started in its own session so the
    whole tree (SGLang spawns scheduler and detokenizer processes) can be stopped together."""

    name: str
    url: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    die_with_parent: bool = False  # SIGKILL the child when its parent dies (Ray actors)

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child owns it for its lifetime)
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
            preexec_fn=_kill_with_parent if self.die_with_parent else None,
        )
        log.close()

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, num_lines: int = 30) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return "".join(deque(f, maxlen=num_lines))
        return ""

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait_s)
                return

    def report(self) -> str:
        code = self.proc.returncode if self.proc is not None else None
        return f"{self.name} ({self.url}) exited with code {code}; last log lines ({self.log_path}):\n{self.tail()}"


def _kill_with_parent() -> None:
    """In the child, before exec: Linux sends SIGKILL when the parent dies, so a server never
    outlives the actor that started it (a killed actor runs no cleanup)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def wait_healthy(
    process: ManagedProcess, *, timeout_s: float, path: str = "/health_generate"
) -> None:
    """Poll `path` until 200; a process that dies meanwhile fails at once with its last log lines."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process.is_alive():
            raise EngineError(f"SGLang failed to start: {process.report()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{process.url}{path}", timeout=30.0).status_code == 200:
                return
        time.sleep(1.0)
    raise EngineError(
        f"{process.name} at {process.url} not healthy after {timeout_s}s; last log lines:\n{process.tail()}"
    )


# SGLang derives a gRPC port of --port + 10000 and refuses to start when that passes 65535
# (0.5.15); Linux's ephemeral range reaches 60999, so ports are drawn below this bound, and
# above Ray's default worker ports (10002-19999), which a Ray head or worker may want.
MIN_SERVER_PORT = 20000
MAX_SERVER_PORT = 55535


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports in [MIN_SERVER_PORT, MAX_SERVER_PORT] (every socket is held
    until all are chosen, so none is handed out twice)."""
    span = range(MIN_SERVER_PORT, MAX_SERVER_PORT + 1)
    candidates = random.Random().sample(span, k=4 * count + 64)
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for port in candidates:
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind((host, port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free ports at or below {MAX_SERVER_PORT} on {host}")


if __name__ == "__main__":
    main(sys.argv[1:])
