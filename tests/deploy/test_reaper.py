"""A local Ray started by `init_ray` listens on loopback only, and nothing of it outlives a
SIGKILLed driver (Ray leaves raylet's agents for minutes); `ray.shutdown()` still ends it and
the reaper with it."""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

_DRIVER = """
import sys, time
import ray
from agentrl.deploy.ray_cluster import init_ray

assert init_ray(None, num_bundles=1)
actor = ray.remote(type("Pinger", (), {"ping": lambda self: 1})).remote()
assert ray.get(actor.ping.remote()) == 1  # a worker process too
print("ready", flush=True)
if sys.stdin.readline().strip() == "shutdown":
    ray.shutdown()
    print("ready", flush=True)
time.sleep(600)
"""

# A tree shaped like Ray's: a root that exits on SIGTERM and a grandchild that ignores it.
_TREE_DRIVER = """
import os, subprocess, sys, time
from agentrl.deploy import reaper

stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
parent = (
    f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {stubborn!r}]); "
    "time.sleep(600)"
)
before = reaper.children(os.getpid())
subprocess.Popen([sys.executable, "-c", parent])
time.sleep(1)  # the grandchild exists before the reaper's first look
reaper.start(reaper.children(os.getpid()) - before)
print("ready", flush=True)
time.sleep(600)
"""


def _start(script: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def _wait_ready(driver: subprocess.Popen[str]) -> None:
    assert driver.stdout is not None
    lines = []
    for line in driver.stdout:  # a dead driver ends the loop
        if line.strip() == "ready":
            return
        lines.append(line)
    pytest.fail(f"the driver exited {driver.wait()} before it was ready: {''.join(lines[-30:])}")


def _session(driver: subprocess.Popen[str]) -> list[psutil.Process]:
    """The driver's descendants and its reaper (which is nobody's child: it was detached)."""
    procs = psutil.Process(driver.pid).children(recursive=True)
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any(a.endswith("reaper.py") for a in cmd) and any(
            a.startswith(f"{driver.pid}:") for a in cmd
        ):
            procs.append(p)
    return procs


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def _listening(procs: list[psutil.Process]) -> list[str]:
    found = []
    for p in _alive(procs):
        try:
            conns = p.net_connections("inet")
        except psutil.NoSuchProcess:
            continue
        found += [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # gRPC's dual-stack sockets: ::ffff:127.0.0.1
    return (mapped or addr).is_loopback


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s  # a bound on the wait, not a timing asserted
    while (left := _alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _describe(procs: list[psutil.Process]) -> list[str]:
    return [f"{p.pid} {p.name()} listening on {_listening([p])}" for p in _alive(procs)]


def test_the_reaper_ends_a_tree_whose_driver_was_killed_even_a_process_ignoring_sigterm():
    driver = _start(_TREE_DRIVER)
    try:
        _wait_ready(driver)
        tree = _session(driver)
        assert len(tree) == 3, _describe(tree)  # the root, its child, the reaper
        driver.kill()
        driver.wait()
        left = _wait_gone(tree, timeout_s=60)
    finally:
        driver.kill()
    assert not left, _describe(left)


@pytest.mark.slow
def test_a_sigkilled_driver_leaves_no_ray_process_and_ray_listens_on_loopback_only():
    driver = _start(_DRIVER)
    try:
        _wait_ready(driver)
        session = _session(driver)
        names = {p.name() for p in session}
        assert {"gcs_server", "raylet", "ray::RuntimeEnvAgent"} <= names, names
        addresses = _listening([psutil.Process(driver.pid), *session])
        assert addresses, "no Ray server found listening"
        assert all(_is_loopback(ip) for ip in addresses), _describe(session)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        left = _wait_gone(session, timeout_s=60)
    finally:
        driver.kill()
    assert not left, _describe(left)


@pytest.mark.slow
def test_a_ray_of_its_own_beside_a_ray_start_cluster_and_ray_shutdown_ends_it_and_the_reaper():
    """No address: a new local Ray, even where `ray start` left its address for `ray.init()`
    to join (it did: another test's cluster, and `num_cpus` was then refused)."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's sockets live there
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    driver = _start(_DRIVER, env={"RAY_TMPDIR": str(ray_tmp), "RAY_ADDRESS": ""})
    try:
        _wait_ready(driver)
        session = _session(driver)
        assert any("reaper.py" in " ".join(p.cmdline()) for p in session), _describe(session)
        assert driver.stdin is not None
        driver.stdin.write("shutdown\n")
        driver.stdin.flush()
        _wait_ready(driver)  # ray.shutdown() returned
        left = _wait_gone(session, timeout_s=60)
        assert driver.poll() is None  # the driver lives on: the reaper left on its own
    finally:
        driver.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, _describe(left)
