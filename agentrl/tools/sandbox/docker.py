"""Docker backend: a warm pool of locked-down containers (no network, read-only root, all
capabilities dropped, uid 65534, memory and pids limits, tmpfs /work and /tmp), each run an
`exec` of a small bootstrap that resets the container before and kills leftovers after.

Every container carries the label `agentrl.sandbox`; those of dead owners are reaped when a
sandbox starts, and a sandbox removes its own on `close()` and at interpreter exit.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from agentrl.tools.sandbox.base import Limits, Program, SandboxResult, SandboxUnavailable
from agentrl.tools.sandbox.image import IMAGE, build_image
from agentrl.tools.sandbox.leases import Leases, default_leases
from agentrl.tools.sandbox.process import ENV, RawRun, rlimits, sandbox_error, to_result

LABEL = "agentrl.sandbox"
PYTHON = "/usr/bin/python3"
INSTALL_HINT = (
    "install Docker (Debian/Ubuntu: apt-get install -y docker.io), start the daemon "
    "(dockerd or systemctl start docker) and `pip install docker`"
)
_BOOT = (Path(__file__).parent / "docker_boot.py").read_text()
_POLL_S = 0.1
# PID 1 of each container: ignores every signal sent from inside and reaps orphans, so
# zombies of daemonized programs never pile up against the pids limit.
_INIT = """
import os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
while True:
    signal.sigwaitinfo({signal.SIGCHLD})
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
"""


class DockerSandbox:
    name = "docker"

    def __init__(
        self,
        *,
        image: str = IMAGE,
        leases: Leases | None = None,
        base_url: str | None = None,
        build: bool = True,
    ) -> None:
        try:
            import docker
        except ImportError as e:
            raise SandboxUnavailable(
                f"docker backend: the `docker` Python package is missing ({e}); {INSTALL_HINT}"
            )
        try:
            self.client = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
            self.client.ping()
        except Exception as e:
            raise SandboxUnavailable(
                f"docker backend: no Docker daemon answers ({type(e).__name__}: {e}); {INSTALL_HINT}"
            )
        self.api = self.client.api
        self.image = build_image(self.client, tag=image) if build else image
        self.leases = leases or default_leases()
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{id(self)}"
        self._idle: dict[tuple[int, ...], list[Any]] = {}
        self._lock = threading.Lock()
        reap_stale(self.client)
        atexit.register(self._remove_all)

    async def run(self, program: Program, limits: Limits | None = None) -> SandboxResult:
        limits = limits or Limits()
        async with self.leases.lease():
            cancel = threading.Event()
            work = asyncio.ensure_future(asyncio.to_thread(self._run_sync, program, limits, cancel))
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                cancel.set()  # the thread resets its container within _POLL_S; hold the lease till then
                with contextlib.suppress(Exception):
                    await work
                raise

    async def close(self) -> None:
        await asyncio.to_thread(self._remove_all)

    # -- one run, in a worker thread ------------------------------------------------------------

    def _run_sync(self, program: Program, limits: Limits, cancel: threading.Event) -> SandboxResult:
        start = time.monotonic()
        key = (
            limits.memory_mb,
            limits.max_processes,
            limits.max_file_size_mb,
            limits.max_open_files,
        )
        try:
            container = self._take(key, limits)
        except Exception as e:
            return sandbox_error(
                self.name, f"cannot start a sandbox container: {type(e).__name__}: {e}"
            )
        is_healthy = False
        ooms_before = _oom_kills(container.id)
        try:
            payload = self._run_payload(program, limits)
            exec_id, raw = self._exec(container, payload, limits, cancel)
            is_killed = raw.is_timeout or raw.is_output_limit or cancel.is_set()
            # A run we had to stop may still be forking or writing: its container is removed
            # (that kills everything in it at once) rather than reset.
            raw.returncode = None if is_killed else self._exit_code(exec_id)
            files = (
                self._fetch(container, program.fetch_files)
                if program.fetch_files and not is_killed
                else {}
            )
            container.reload()
            raw.wall_s = time.monotonic() - start
            # 137: the bootstrap itself was SIGKILLed (OOM, or the program killed it), so it may
            # not have swept the run's processes: retire the container.
            is_healthy = container.status == "running" and not is_killed and raw.returncode != 137
            ooms_after = _oom_kills(container.id)
            if ooms_before is not None and ooms_after is not None:
                is_oom = ooms_after > ooms_before
            else:  # cgroup not readable from here: 137 without our kill is most likely the OOM killer
                is_oom = raw.returncode == 137 and not is_killed
            is_oom = is_oom or container.attrs["State"].get("OOMKilled", False)
            return to_result(raw, backend=self.name, is_oom=is_oom, files=files)
        except Exception as e:
            return sandbox_error(self.name, f"{type(e).__name__}: {e}", time.monotonic() - start)
        finally:
            self._give_back(key, container, is_healthy)

    def _run_payload(self, program: Program, limits: Limits) -> dict[str, Any]:
        return {
            "op": "run",
            "argv": program.argv(PYTHON),
            "env": {**ENV, "HOME": "/work"},
            "files": {k: base64.b64encode(v).decode() for k, v in program.all_files().items()},
            "stdin": base64.b64encode(program.stdin_bytes()).decode(),
            "rlimits": rlimits(limits, has_cgroup=True, with_nproc=False),  # the container's
        }

    def _exec(
        self, container: Any, payload: dict[str, Any], limits: Limits, cancel: threading.Event
    ) -> tuple[str, RawRun]:
        body = json.dumps(payload).encode()
        exec_id = self.api.exec_create(
            container.id,
            [PYTHON, "-I", "-c", _BOOT],
            stdin=True,
            stdout=True,
            stderr=True,
            user="65534:65534",
            workdir="/work",
            environment={},
        )["Id"]
        sock = self.api.exec_start(exec_id, socket=True)
        conn: Any = getattr(sock, "_sock", sock)  # the socket under docker-py's wrapper
        try:
            conn.sendall(b"%d\n" % len(body) + body)
            return exec_id, _pump_frames(conn, limits, cancel)
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            with contextlib.suppress(OSError):
                sock.close()

    def _exit_code(self, exec_id: str) -> int | None:
        for _ in range(50):
            info = self.api.exec_inspect(exec_id)
            if not info.get("Running") and info.get("ExitCode") is not None:
                return int(info["ExitCode"])
            time.sleep(0.02)
        return None

    def _fetch(self, container: Any, names: list[str]) -> dict[str, bytes]:
        limits = Limits(timeout_s=30, max_output_bytes=1 << 28)
        _, raw = self._exec(
            container, {"op": "fetch", "fetch_files": names}, limits, threading.Event()
        )
        return {k: base64.b64decode(v) for k, v in json.loads(raw.stdout or b"{}").items()}

    # -- the pool -------------------------------------------------------------------------------

    def _take(self, key: tuple[int, ...], limits: Limits) -> Any:
        with self._lock:
            idle = self._idle.get(key, [])
            if idle:
                return idle.pop()
        return self._create(limits)

    def _give_back(self, key: tuple[int, ...], container: Any, is_healthy: bool) -> None:
        if is_healthy:
            with self._lock:
                self._idle.setdefault(key, []).append(container)
            return
        with contextlib.suppress(Exception):
            container.remove(force=True)

    def _create(self, limits: Limits) -> Any:
        from docker.types import Ulimit

        tmpfs_opts = f"size={limits.max_file_size_bytes},mode=1777,nosuid,nodev"
        return self.client.containers.run(
            self.image,
            [PYTHON, "-I", "-c", _INIT],
            detach=True,
            labels={LABEL: "1", f"{LABEL}.owner": self.owner},
            network_mode="none",
            mem_limit=limits.memory_bytes,
            memswap_limit=limits.memory_bytes,
            pids_limit=limits.max_processes,
            read_only=True,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            user="65534:65534",
            tmpfs={"/work": tmpfs_opts, "/tmp": tmpfs_opts},
            working_dir="/work",
            environment={},
            ipc_mode="none",
            ulimits=[
                Ulimit(name="nofile", soft=limits.max_open_files, hard=limits.max_open_files),
                Ulimit(
                    name="fsize", soft=limits.max_file_size_bytes, hard=limits.max_file_size_bytes
                ),
                Ulimit(name="core", soft=0, hard=0),
            ],
        )

    def _remove_all(self) -> None:
        with self._lock:
            self._idle.clear()
        try:
            mine = self.client.containers.list(
                all=True, filters={"label": f"{LABEL}.owner={self.owner}"}
            )
        except Exception:  # the daemon is gone (e.g. at interpreter exit): nothing to reach
            return
        for c in mine:
            with contextlib.suppress(Exception):
                c.remove(force=True)


def _pump_frames(conn: socket.socket, limits: Limits, cancel: threading.Event) -> RawRun:
    """Demultiplex Docker's attach stream (8-byte headers: stream id, 3 zero bytes, big-endian
    length) under the wall clock and the shared output budget, until EOF, a limit or `cancel`.
    The exit code and wall time are the caller's to fill in."""
    sinks = {1: bytearray(), 2: bytearray()}  # stdout, stderr
    run = RawRun(None, b"", b"")
    deadline = time.monotonic() + limits.timeout_s
    left = limits.max_output_bytes
    buf = b""
    while not cancel.is_set() and not run.is_output_limit:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            run.is_timeout = True
            break
        conn.settimeout(min(_POLL_S, remaining))
        try:
            chunk = conn.recv(1 << 16)
        except TimeoutError:
            continue
        if not chunk:
            break
        buf += chunk
        while len(buf) >= 8 and len(buf) >= 8 + int.from_bytes(buf[4:8], "big"):
            size = int.from_bytes(buf[4:8], "big")
            stream, data, buf = 2 if buf[0] == 2 else 1, buf[8 : 8 + size], buf[8 + size :]
            sinks[stream] += data[:left]
            if len(data) > left:
                setattr(run, "stderr_truncated" if stream == 2 else "stdout_truncated", True)
                run.is_output_limit = True
                break
            left -= len(data)
    run.stdout = bytes(sinks[1])
    run.stderr = bytes(sinks[2])
    return run


def _oom_kills(container_id: str) -> int | None:
    """The container cgroup's OOM-kill count (v1 cgroupfs or v2 layouts), None if unreadable."""
    for path in (
        f"/sys/fs/cgroup/memory/docker/{container_id}/memory.oom_control",
        f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/memory.events",
        f"/sys/fs/cgroup/docker/{container_id}/memory.events",
    ):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(path).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    return None


def reap_stale(client: Any) -> None:
    """Remove sandbox containers whose owning process on this host is gone."""
    host = socket.gethostname()
    for c in client.containers.list(all=True, filters={"label": LABEL}):
        owner = c.labels.get(f"{LABEL}.owner", "")
        owner_host, _, rest = owner.partition(":")
        pid = rest.split(":", 1)[0]
        if owner_host == host and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(Exception):
                c.remove(force=True)


def is_available() -> tuple[bool, str]:
    try:
        import docker

        docker.from_env().ping()
        return True, ""
    except ImportError:
        return False, f"the `docker` Python package is missing; {INSTALL_HINT}"
    except Exception as e:
        return False, f"no Docker daemon answers ({type(e).__name__}); {INSTALL_HINT}"
