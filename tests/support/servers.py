"""`agentrl serve` in the background, for tests and benchmarks: any ASGI app under uvicorn in a
thread (`run_app_in_thread` -> `ServerThread`; `start_server_thread` for an engine), or the real CLI
as its own process (`serve_subprocess`)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class ServerThread:
    """`agentrl serve` in a background thread (tests, benchmarks); `.url`, `.stop()`."""

    url: str
    server: Any
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def run_app_in_thread(app: Any, *, host: str = "127.0.0.1", port: int = 0) -> ServerThread:
    """Any ASGI app under uvicorn in a daemon thread, on a port bound before it starts (0 = free)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="agentrl-serve"
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"server thread did not start on {host}:{sock.getsockname()[1]}")
        time.sleep(0.01)
    return ServerThread(f"http://{host}:{sock.getsockname()[1]}", server, thread)


def start_server_thread(
    engine: Any, *, host: str = "127.0.0.1", port: int = 0, **app_kwargs: Any
) -> ServerThread:
    """`agentrl serve`'s app around `engine`, in a background thread."""
    from agentrl.engine.serve import create_app

    return run_app_in_thread(create_app(engine, **app_kwargs), host=host, port=port)


@contextlib.contextmanager
def serve_subprocess(
    model_path: str, log_path: str | Path, *, device: str = "cpu", env: dict[str, str] | None = None
) -> Iterator[str]:
    """`agentrl serve` as its own process, as agentrl's supervisor starts one; yields its URL once
    it serves, and stops it on exit. Output goes to `log_path`."""
    from agentrl.deploy.processes import ManagedProcess, free_ports, wait_healthy

    (port,) = free_ports(1)
    # The child imports this same agentrl, installed or not.
    package_root = str(Path(__file__).resolve().parents[2])  # the repository root
    python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "agentrl.cli", "serve", "--model", model_path,
           "--port", str(port), "--device", device, "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, **(env or {}), "PYTHONPATH": python_path}
    server = ManagedProcess("agentrl-serve", f"http://127.0.0.1:{port}", cmd, Path(log_path), env)
    server.start()
    try:
        wait_healthy(server, timeout_s=300)
        yield server.url
    finally:
        server.stop(timeout_s=30)
