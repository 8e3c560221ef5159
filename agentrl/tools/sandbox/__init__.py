"""Sandboxed execution of untrusted programs: the `Sandbox` protocol, its backends
(bubblewrap, Docker, an opt-in unsafe subprocess) and the global concurrency leases."""

from agentrl.tools.sandbox.base import (
    Limits,
    Program,
    Sandbox,
    SandboxResult,
    SandboxStatus,
    SandboxUnavailable,
)
from agentrl.tools.sandbox.factory import BACKENDS, backend_status, make_sandbox
from agentrl.tools.sandbox.leases import Leases, default_leases

__all__ = [
    "BACKENDS",
    "Leases",
    "Limits",
    "Program",
    "Sandbox",
    "SandboxResult",
    "SandboxStatus",
    "SandboxUnavailable",
    "backend_status",
    "default_leases",
    "make_sandbox",
]
