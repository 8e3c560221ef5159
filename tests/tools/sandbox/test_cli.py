"""`agentrl sandbox run FILE` prints the result as JSON; its exit status says how it went."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from agentrl.cli import app

from .conftest import get_sandbox


def test_sandbox_run_prints_json(tmp_path) -> None:
    get_sandbox("bubblewrap")  # skips (or fails in CI) without bubblewrap
    program = tmp_path / "p.py"
    program.write_text("import sys\nprint('got', sys.stdin.read())\nsys.exit(2)\n")
    stdin = tmp_path / "in.txt"
    stdin.write_text("hello")
    args = [
        "sandbox",
        "run",
        str(program),
        "--backend",
        "bubblewrap",
        "--timeout-s",
        "5",
        "--memory-mb",
        "256",
        "--stdin",
        str(stdin),
    ]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 1, out.output
    result = json.loads(out.output)
    assert (
        result["status"] == "runtime_error"
        and result["exit_code"] == 2
        and result["stdout"] == "got hello\n"
    )
    assert set(result) >= {"status", "exit_code", "stdout", "stderr", "wall_s", "truncated"}


def test_sandbox_run_timeout_and_unsafe_refusal(tmp_path) -> None:
    get_sandbox("bubblewrap")
    program = tmp_path / "p.py"
    program.write_text("import time\ntime.sleep(60)\n")
    out = CliRunner().invoke(app, ["sandbox", "run", str(program), "--timeout-s", "1"])
    assert json.loads(out.output)["status"] == "timeout"
    out = CliRunner().invoke(app, ["sandbox", "run", str(program), "--backend", "subprocess"])
    assert out.exit_code == 2 and "allow_unsafe" in json.loads(out.output)["error"]
