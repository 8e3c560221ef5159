"""Pick a sandbox backend by name: `auto` = bubblewrap, else Docker, else an error naming both."""

from __future__ import annotations

from typing import Any, Literal

from agentrl.tools.sandbox.base import Sandbox, SandboxUnavailable
from agentrl.tools.sandbox.leases import Leases

Backend = Literal["auto", "bubblewrap", "docker", "subprocess"]
BACKENDS: tuple[str, ...] = ("bubblewrap", "docker", "subprocess")


def make_sandbox(
    backend: Backend | str = "auto",
    *,
    allow_unsafe: bool = False,
    leases: Leases | None = None,
    **kwargs: Any,
) -> Sandbox:
    """A ready sandbox. `kwargs` go to the backend's constructor. Raises SandboxUnavailable
    (saying what to install) when the backend cannot run here."""
    if backend == "auto":
        return _auto(leases, kwargs)
    if backend == "bubblewrap":
        from agentrl.tools.sandbox.bubblewrap import BubblewrapSandbox, is_available

        ok, why = is_available()
        if not ok:
            raise SandboxUnavailable(f"bubblewrap backend: {why}")
        return BubblewrapSandbox(leases=leases, **kwargs)
    if backend == "docker":
        from agentrl.tools.sandbox.docker import DockerSandbox

        return DockerSandbox(leases=leases, **kwargs)
    if backend == "subprocess":
        from agentrl.tools.sandbox.subprocess_sandbox import SubprocessSandbox

        return SubprocessSandbox(allow_unsafe=allow_unsafe, leases=leases, **kwargs)
    raise ValueError(f"sandbox backend={backend!r} is not one of auto, {', '.join(BACKENDS)}")


def _auto(leases: Leases | None, kwargs: dict[str, Any]) -> Sandbox:
    reasons = []
    for name in ("bubblewrap", "docker"):
        try:
            return make_sandbox(name, leases=leases, **kwargs)
        except SandboxUnavailable as e:
            reasons.append(str(e))
    raise SandboxUnavailable(
        "no sandbox backend is available: "
        + " | ".join(reasons)
        + " (the unsandboxed `subprocess` backend runs only with allow_unsafe=True)"
    )


def backend_status() -> dict[str, tuple[bool, str]]:
    """backend -> (usable here, why not): for `agentrl sandbox` diagnostics and tests."""
    from agentrl.tools.sandbox import bubblewrap, docker

    return {"bubblewrap": bubblewrap.is_available(), "docker": docker.is_available()}
