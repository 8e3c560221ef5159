"""Every bad input of REFERENCE §3 on each backend: the expected status, a clean host, and a
working next run. The unsafe subprocess backend runs only the resource-limit cases."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentrl.tools.sandbox import Limits, Program, SandboxStatus

from .conftest import REAL_BACKENDS, assert_host_clean, get_sandbox, marked, status_of, work_dirs

ALL_BACKENDS = (*REAL_BACKENDS, "subprocess")
FAST = Limits(
    timeout_s=2.0, memory_mb=256, max_processes=32, max_file_size_mb=16, max_output_bytes=1 << 16
)

pytestmark = pytest.mark.sandbox

# (name, code, expected statuses, backends)
LIMIT_CASES = [
    ("busy_loop", "while True: pass", {SandboxStatus.TIMEOUT}),
    ("sleep", "import time; time.sleep(1e6)", {SandboxStatus.TIMEOUT}),
    (
        "ignore_sigterm",
        "import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "for _ in range(3):\n    if os.fork() == 0: break\nwhile True: time.sleep(1)",
        {SandboxStatus.TIMEOUT},
    ),
    ("allocate_10gb", "x = bytearray(10 * 1024**3)\nprint(len(x))", {SandboxStatus.MEMORY}),
    (
        "fork_bomb",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        {SandboxStatus.TIMEOUT, SandboxStatus.RUNTIME_ERROR, SandboxStatus.MEMORY},
    ),
    (
        "stdout_1gb",
        "import sys\nfor _ in range(16384): sys.stdout.write('x' * 65536)",
        {SandboxStatus.OUTPUT_LIMIT},
    ),
    (
        "file_1gb",
        "with open('big.bin', 'wb') as f:\n    for _ in range(1024): f.write(b'x' * (1 << 20))",
        {SandboxStatus.RUNTIME_ERROR},
    ),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("name,code,expected", LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
async def test_resource_limits(
    backend: str, name: str, code: str, expected: set[SandboxStatus]
) -> None:
    sandbox = get_sandbox(backend)
    before = work_dirs()
    program, marker = marked(code)
    result = await sandbox.run(program, FAST)
    assert result.status in expected, status_of(result)
    if name == "stdout_1gb":
        assert result.stdout_truncated and len(result.stdout) <= FAST.max_output_bytes
    if name == "file_1gb":
        assert "File too large" in result.stderr or "No space left" in result.stderr, status_of(
            result
        )
    assert_host_clean(marker, before)
    after = await sandbox.run(Program(code="print('next run works')"), FAST)
    assert after.status is SandboxStatus.OK and after.stdout == "next run works\n", status_of(after)


ISOLATION_CASES = [
    (
        "read_secrets",
        "import os\nfor p in ['/etc/shadow', '/root/.ssh/id_rsa', os.path.expanduser('~/.ssh/id_rsa')]:\n"
        "    try:\n        open(p).read(); print('READ', p)\n    except OSError as e:\n        print('absent', type(e).__name__)",
    ),
    (
        "write_outside",
        "for p in ['/usr/agentrl_evil', '/agentrl_evil', '/etc/agentrl_evil', '/work/../usr/agentrl_evil']:\n"
        "    try:\n        open(p, 'w').write('x'); print('WROTE', p)\n    except OSError as e:\n        print('refused', type(e).__name__)",
    ),
    (
        "network",
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=2); print('CONNECTED')\n"
        "except OSError as e:\n    print('no network', type(e).__name__)\n"
        "try:\n    socket.getaddrinfo('example.com', 80); print('RESOLVED')\nexcept OSError as e:\n    print('no dns', type(e).__name__)",
    ),
    (
        "kill_pid_1",
        "import os, signal\nfor pid in (1, -1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n"
        "        print('refused', e)\nprint('still here')",
    ),
    (
        "environment",
        "import os\nprint(sorted(os.environ))\nprint(os.environ.get('AGENTRL_TEST_SECRET', 'no secret'))",
    ),
]


@pytest.mark.parametrize("backend", REAL_BACKENDS)
@pytest.mark.parametrize("name,code", ISOLATION_CASES, ids=[c[0] for c in ISOLATION_CASES])
async def test_isolation(
    backend: str, name: str, code: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTRL_TEST_SECRET", "s3cret")
    sandbox = get_sandbox(backend)
    before = work_dirs()
    result = await sandbox.run(Program(code=code), FAST)
    # kill(-1) may take the Docker run's own supervisor down with it: the program's loss only.
    allowed = (
        {SandboxStatus.OK, SandboxStatus.RUNTIME_ERROR}
        if name == "kill_pid_1"
        else {SandboxStatus.OK}
    )
    assert result.status in allowed, status_of(result)
    for forbidden in ("READ", "WROTE", "CONNECTED", "RESOLVED", "s3cret"):
        assert forbidden not in result.stdout, result.stdout
    if name == "kill_pid_1":
        assert "still here" in result.stdout
    if name == "environment":
        assert set(eval(result.stdout.splitlines()[0])) <= {
            "PATH",
            "HOME",
            "LANG",
            "LC_CTYPE",
            "PWD",
            "PYTHONDONTWRITEBYTECODE",
        }
    assert not Path("/usr/agentrl_evil").exists() and not Path("/agentrl_evil").exists()
    assert_host_clean(None, before)
    after = await sandbox.run(Program(code="print('ok')"), FAST)
    assert after.ok, status_of(after)


@pytest.mark.parametrize("backend", REAL_BACKENDS)
async def test_symlink_to_host_file_is_never_followed(backend: str) -> None:
    code = "import os\nos.symlink('/etc/passwd', 'out.txt')\nos.symlink('/etc', 'd')\nopen('real.txt', 'w').write('mine')"
    program = Program(code=code, fetch_files=["out.txt", "d/passwd", "real.txt"])
    result = await get_sandbox(backend).run(program, FAST)
    assert result.status is SandboxStatus.OK, status_of(result)
    assert result.files == {"real.txt": b"mine"}


@pytest.mark.parametrize("backend", REAL_BACKENDS + (("subprocess",) if os.geteuid() == 0 else ()))
async def test_daemonized_grandchild_dies_with_the_run(backend: str) -> None:
    code = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        while True: time.sleep(0.1)\n    os._exit(0)\nprint('parent done')"
    )
    before = work_dirs()
    program, marker = marked(code)
    result = await get_sandbox(backend).run(program, FAST)
    assert result.status is SandboxStatus.OK and "parent done" in result.stdout, status_of(result)
    assert_host_clean(marker, before)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
async def test_non_utf8_output_is_replaced(backend: str) -> None:
    code = "import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end')\nsys.stderr.buffer.write(b'\\xc3')"
    result = await get_sandbox(backend).run(Program(code=code), FAST)
    assert result.status is SandboxStatus.OK, status_of(result)
    assert result.stdout == "ok \ufffd\ufffd end" and result.stderr == "\ufffd"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
async def test_stdin_files_and_exit_code(backend: str) -> None:
    code = "import sys\ndata = sys.stdin.read()\nopen('out.txt', 'w').write(open('in.txt').read() + data)\nsys.exit(3)"
    program = Program(
        code=code, stdin="from stdin", files={"in.txt": "from file, "}, fetch_files=["out.txt"]
    )
    result = await get_sandbox(backend).run(program, FAST)
    assert result.status is SandboxStatus.RUNTIME_ERROR and result.exit_code == 3, status_of(result)
    assert result.files == {"out.txt": b"from file, from stdin"}


def test_no_stray_work_dirs_at_module_end() -> None:
    assert not [p for p in os.listdir("/") if p.startswith("agentrl_evil")]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
async def test_cpu_limit_fires_before_the_wall_clock(backend: str) -> None:
    result = await get_sandbox(backend).run(
        Program(code="while True: pass"), Limits(timeout_s=20, cpu_s=1)
    )
    assert result.status is SandboxStatus.TIMEOUT and result.error == "CPU-time limit (cpu_s)", (
        status_of(result)
    )
