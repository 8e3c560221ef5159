"""The `Sandbox` protocol and its data: a program, its limits, and what came of running it."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from pydantic import PositiveFloat, PositiveInt
from pydantic.dataclasses import dataclass as checked_dataclass


class SandboxStatus(str, enum.Enum):
    """How a run ended. SANDBOX_ERROR is the sandbox's own failure, never the program's."""

    OK = "ok"
    RUNTIME_ERROR = "runtime_error"  # non-zero exit or killed by a signal we did not send
    TIMEOUT = "timeout"  # wall clock or CPU time
    MEMORY = "memory"  # memory limit (OOM-kill or MemoryError)
    OUTPUT_LIMIT = "output_limit"  # stdout + stderr passed max_output_bytes
    SANDBOX_ERROR = "sandbox_error"


class SandboxUnavailable(RuntimeError):
    """A backend cannot run on this machine; the message says what to install or start."""


@dataclass
class Program:
    """What to run. Either `code` (run as `main.py` with `language`'s interpreter) or `command`
    (argv, run in the work dir). `files` are written into the work dir first (relative paths);
    `fetch_files` are read back from it afterwards."""

    code: str | None = None
    command: list[str] | None = None
    language: str = "python"
    stdin: bytes | str = b""
    files: dict[str, bytes | str] = field(default_factory=dict)
    fetch_files: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if (self.code is None) == (self.command is None):
            raise ValueError("Program needs exactly one of `code` or `command`")
        if self.language != "python" and self.code is not None:
            raise ValueError(
                f"Program.language={self.language!r}: only 'python' code is supported; pass `command` for others"
            )
        for name in [*self.files, *self.fetch_files]:
            if name.startswith("/") or ".." in name.split("/"):
                raise ValueError(
                    f"Program file name {name!r} must be relative and stay inside the work dir"
                )

    def argv(self, python: str) -> list[str]:
        """`command`, or `python main.py` for code."""
        return self.command if self.command is not None else [python, "main.py"]

    def stdin_bytes(self) -> bytes:
        return self.stdin.encode() if isinstance(self.stdin, str) else self.stdin

    def all_files(self) -> dict[str, bytes]:
        files = {k: v.encode() if isinstance(v, str) else v for k, v in self.files.items()}
        if self.code is not None:
            files["main.py"] = self.code.encode()
        return files


@checked_dataclass
class Limits:
    """Per-run limits. Every backend enforces all of them (network is always off); a value
    <= 0 is refused at construction (pydantic's ValidationError, a ValueError)."""

    timeout_s: PositiveFloat = 10.0
    """Wall clock: the only limit a sleeping program hits."""
    cpu_s: float | None = None
    """CPU seconds (RLIMIT_CPU); None = timeout_s rounded up."""
    memory_mb: PositiveInt = 512
    max_processes: PositiveInt = 64
    max_file_size_mb: PositiveInt = 64
    """Largest file a program may write (RLIMIT_FSIZE), also the size of the work dir."""
    max_open_files: PositiveInt = 256
    max_output_bytes: PositiveInt = 1 << 20
    """stdout + stderr bytes kept; one more byte kills the run (OUTPUT_LIMIT)."""

    @property
    def cpu_limit_s(self) -> int:
        return int(-(-(self.cpu_s or self.timeout_s) // 1))

    @property
    def memory_bytes(self) -> int:
        return self.memory_mb << 20

    @property
    def max_file_size_bytes(self) -> int:
        return self.max_file_size_mb << 20


@dataclass
class SandboxResult:
    status: SandboxStatus
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    files: dict[str, bytes] = field(default_factory=dict)
    backend: str = ""
    error: str | None = None
    """Why, for SANDBOX_ERROR (and which limit, for limit statuses)."""

    @property
    def ok(self) -> bool:
        return self.status is SandboxStatus.OK

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = self.status.value
        out["truncated"] = self.truncated
        out["files"] = {k: v.decode("utf-8", "replace") for k, v in self.files.items()}
        return out


@runtime_checkable
class Sandbox(Protocol):
    """Runs untrusted programs. `run` never raises for anything the program does; a broken
    sandbox comes back as SANDBOX_ERROR. Nothing the program started outlives `run`."""

    name: str

    async def run(self, program: Program, limits: Limits | None = None) -> SandboxResult: ...

    async def close(self) -> None: ...
