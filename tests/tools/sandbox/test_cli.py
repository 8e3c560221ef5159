"""`agentrl sandbox run FILE` prints the result as JSON; its exit status says how it went."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.tools.sandbox import cgroups

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


def test_sigterm_kills_the_program_and_removes_its_cgroup_and_work_dir(tmp_path) -> None:
    """A real `agentrl sandbox run` process, stopped by SIGTERM mid-run (as a job scheduler
    does): the program dies, the run's cgroup and work dir (a tmpfs mount) go, exit 143."""
    get_sandbox("bubblewrap")
    program = tmp_path / "p.py"
    program.write_text("import time\ntime.sleep(120)\n")
    cmd = [sys.executable, "-m", "agentrl.cli", "sandbox", "run", str(program),
           "--backend", "bubblewrap", "--timeout-s", "120"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        work_dirs, run_cgroups, pids = [], [], set()
        while not pids:  # the program is running inside its cgroup
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the sandboxed program never started"
            time.sleep(0.1)
            work_dirs = list(Path(tempfile.gettempdir()).glob(f"agentrl-sbx-{proc.pid}-*"))
            parents = cgroups._parents() or []
            run_cgroups = [d for p in parents for d in p.glob(f"{proc.pid}-*")]
            pids = {int(p) for d in run_cgroups for p in (d / "cgroup.procs").read_text().split()}
        assert work_dirs and run_cgroups
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip() == "error: stopped by SIGTERM; the program was killed"
    assert "Traceback" not in stderr and stdout == ""
    assert [d for d in work_dirs if d.exists()] == [], "the work dir was left behind"
    assert not any(str(d) in Path("/proc/mounts").read_text() for d in work_dirs)
    assert [d for d in run_cgroups if d.exists()] == [], "the run cgroup was left behind"
    assert [p for p in pids if _is_alive(p)] == [], "the program outlived the run"


def _is_alive(pid: int) -> bool:
    """Running, not a zombie waiting for init to reap it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status
