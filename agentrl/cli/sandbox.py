"""`agentrl sandbox run FILE` (run a program once, print the result as JSON) and
`agentrl sandbox status` (which backends work here)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
from collections.abc import Iterator
from pathlib import Path

import typer

from agentrl.cli import UserCommand, fail


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="Run programs in the sandbox (debugging, scripted checks).", no_args_is_help=True
    )

    @group.command("run", cls=UserCommand)
    def run_command(
        file: Path = typer.Argument(
            ..., exists=True, dir_okay=False, help="Python program to run."
        ),
        backend: str = typer.Option("auto", help="auto, bubblewrap, docker or subprocess."),
        timeout_s: float = typer.Option(10.0, help="Wall-clock limit in seconds (> 0)."),
        memory_mb: int = typer.Option(512, help="Memory limit in MiB (> 0)."),
        stdin: Path | None = typer.Option(
            None, exists=True, dir_okay=False, help="File fed to the program's stdin."
        ),
        allow_unsafe: bool = typer.Option(False, help="Permit the unsandboxed subprocess backend."),
    ) -> None:
        """Run FILE once under the limits and print status, exit_code, stdout, stderr, wall_s,
        truncated as JSON. Exit status: 0 when the program ran OK, 1 otherwise, 2 if no sandbox or bad input."""
        from agentrl.tools.sandbox import Limits, Program, SandboxUnavailable, make_sandbox

        # Checked here, before a sandbox exists, so each error names the flag as typed.
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            fail(f"--timeout-s={timeout_s:g} must be a finite number > 0; e.g. --timeout-s 10")
        if memory_mb <= 0:
            fail(f"--memory-mb={memory_mb} must be > 0; e.g. --memory-mb 512")
        program = Program(code=_read_program(file), stdin=stdin.read_bytes() if stdin else b"")
        limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb)
        try:
            sandbox = make_sandbox(backend, allow_unsafe=allow_unsafe)
        except (SandboxUnavailable, PermissionError, ValueError) as e:
            typer.echo(json.dumps({"status": "sandbox_error", "error": str(e)}))
            raise typer.Exit(2)

        received: list[int] = []

        async def go():
            try:
                with _cancelled_on_signals(received):
                    return await sandbox.run(program, limits)
            finally:
                await sandbox.close()

        try:
            result = asyncio.run(go())
        except (asyncio.CancelledError, KeyboardInterrupt):
            # The run's cgroup and work dir went with the cancelled run (its `finally`).
            signum = received[0] if received else signal.SIGINT
            name = signal.Signals(signum).name
            typer.secho(f"error: stopped by {name}; the program was killed", err=True)
            raise typer.Exit(128 + signum) from None
        out = result.to_dict()
        out.pop("files")
        typer.echo(json.dumps(out, indent=2))
        raise typer.Exit(0 if result.ok else 1)

    @group.command("status", cls=UserCommand)
    def status_command() -> None:
        """Whether each real backend can run on this machine, and what to install if not."""
        from agentrl.tools.sandbox import backend_status

        for name, (ok, why) in backend_status().items():
            typer.echo(f"{name}: {'ok' if ok else 'unavailable: ' + why}")

    app.add_typer(group, name="sandbox")


@contextlib.contextmanager
def _cancelled_on_signals(received: list[int]) -> Iterator[None]:
    """SIGTERM and SIGHUP cancel the run, as Ctrl-C does under `asyncio.run`: the default action
    would end the process at once and leave the run's cgroup and work dir (a tmpfs) behind.
    The signals that came are appended to `received`."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def cancel(signum: int) -> None:
        received.append(signum)
        task.cancel()

    signals = (signal.SIGTERM, signal.SIGHUP)
    for signum in signals:
        loop.add_signal_handler(signum, cancel, signum)
    try:
        yield
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


def _read_program(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        fail(
            f"FILE {file} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
            "save it as UTF-8"
        )
    except OSError as e:
        fail(f"FILE {file} cannot be read ({e.strerror}); check its permissions")
