"""Any ASGI app (`agentrl serve`'s, or a test's fake) under uvicorn in a background thread, for
tests and benchmarks: `run_app_in_thread` -> `ServerThread` (`.url`, `.stop()`)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
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
