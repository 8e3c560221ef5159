"""Sandbox fixtures: one sandbox per backend for the whole session (Docker keeps a warm pool).
In CI (CI=true) a missing backend fails the test; elsewhere it skips saying what to install."""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from agentrl.tools.sandbox import Leases, Program, SandboxResult, make_sandbox
from agentrl.tools.sandbox.factory import backend_status

IS_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
REAL_BACKENDS = ("bubblewrap", "docker")
_cache: dict[str, object] = {}


def get_sandbox(name: str):
    if name not in _cache:
        if name != "subprocess":
            ok, why = backend_status()[name]
            if not ok:
                message = f"sandbox backend {name!r} is unavailable: {why}"
                if IS_CI:
                    pytest.fail(
                        f"{message} (CI must run every backend: see scripts/setup_sandbox.sh)"
                    )
                pytest.skip(message)
        _cache[name] = make_sandbox(name, allow_unsafe=True, leases=Leases(4))
    return _cache[name]


def pytest_sessionfinish(session, exitstatus):
    docker = _cache.get("docker")
    if docker is not None:
        docker._remove_all()


def marked(code: str) -> tuple[Program, str]:
    """A program whose processes (forks included) carry a unique marker in their command line,
    so the host can look for strays in /proc afterwards."""
    marker = f"agentrl-test-{uuid.uuid4().hex}"
    return Program(command=["python3", "-c", code, marker]), marker


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def work_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob(f"agentrl-sbx-{os.getpid()}-*")}


def own_cgroups() -> list[Path]:
    from agentrl.tools.sandbox.cgroups import live_run_cgroups

    return live_run_cgroups()


def assert_host_clean(marker: str | None, dirs_before: set[str]) -> None:
    deadline = time.monotonic() + 5
    while marker and processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    if marker:
        assert processes_with(marker) == [], "a sandboxed process outlived its run"
    assert work_dirs() - dirs_before == set(), "a work dir was left behind"
    assert own_cgroups() == [], "a run cgroup was left behind"


def status_of(result: SandboxResult) -> str:
    return f"{result.status.value} exit={result.exit_code} error={result.error} stderr={result.stderr[-400:]!r}"
