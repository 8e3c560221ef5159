"""Leases cap concurrent runs and come back on cancel; the factory names what to install."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.tools.sandbox import (
    Leases,
    Limits,
    Program,
    SandboxStatus,
    SandboxUnavailable,
    factory,
    make_sandbox,
)

from .conftest import assert_host_clean, get_sandbox, marked, work_dirs


async def test_leases_cap_concurrency_and_release_on_cancel() -> None:
    leases = Leases(2)
    peak = 0

    async def hold() -> None:
        nonlocal peak
        async with leases.lease():
            peak = max(peak, leases.in_use)
            await asyncio.sleep(0.05)

    await asyncio.gather(*(hold() for _ in range(6)))
    assert peak == 2 and leases.in_use == 0
    blocker = asyncio.create_task(hold())
    waiters = [asyncio.create_task(hold()) for _ in range(3)]
    await asyncio.sleep(0.01)
    for w in waiters:
        w.cancel()
    await asyncio.gather(blocker, *waiters, return_exceptions=True)
    assert leases.in_use == 0


def test_leases_reject_zero() -> None:
    with pytest.raises(ValueError, match="max_concurrency=0"):
        Leases(0)


@pytest.mark.parametrize("backend", ["bubblewrap", "docker"])
async def test_cancelled_run_frees_its_lease_and_kills_the_program(backend: str) -> None:
    sandbox = get_sandbox(backend)
    before = work_dirs()
    program, marker = marked("import time; time.sleep(1e6)")
    task = asyncio.create_task(sandbox.run(program, Limits(timeout_s=30)))
    await asyncio.sleep(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sandbox.leases.in_use == 0
    assert_host_clean(marker, before)
    assert (await sandbox.run(Program(code="print(1)"))).status is SandboxStatus.OK


def test_subprocess_backend_refuses_without_opt_in() -> None:
    with pytest.raises(PermissionError, match="allow_unsafe=True"):
        make_sandbox("subprocess")


def test_unknown_backend_is_named() -> None:
    with pytest.raises(ValueError, match="backend='nsjail'"):
        make_sandbox("nsjail")


def test_auto_without_backends_names_both(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(name, **kwargs):
        if name in ("bubblewrap", "docker"):
            raise SandboxUnavailable(f"{name} backend: install {name}")
        raise AssertionError(name)

    monkeypatch.setattr(
        factory,
        "make_sandbox",
        lambda name="auto", **kw: factory._auto(None, {}) if name == "auto" else unavailable(name),
    )
    with pytest.raises(SandboxUnavailable) as e:
        factory.make_sandbox("auto")
    assert (
        "bubblewrap" in str(e.value) and "docker" in str(e.value) and "allow_unsafe" in str(e.value)
    )


def test_program_validation() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        Program()
    with pytest.raises(ValueError, match="inside the work dir"):
        Program(code="", files={"../x": "y"})
    with pytest.raises(ValueError, match="timeout_s"):
        Limits(timeout_s=0)
