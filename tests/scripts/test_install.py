"""scripts/install.sh picks torch's build by the machine (issue 39): the CPU index without a GPU
where it answers, else the CPU wheel pip finds, else PyPI's build with a note of what it is.
Its functions run sourced, pip replaced by a recorder (nothing is installed)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install.sh"
UNREACHABLE = "http://127.0.0.1:9/whl/cpu"  # the discard port: refused at once
WHEEL_URL = "file:///opt/wheels/torch.whl"


def _install_torch(
    tmp_path: Path, *, has_gpu: bool, index: str, dry_run_version: str
) -> tuple[str, str]:
    """install_torch's output and the pip calls it made (one per line)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if has_gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    wheel = {"metadata": {"version": dry_run_version}, "download_info": {"url": WHEEL_URL}}
    report = {"install": [wheel]}
    pip = tmp_path / "pip"
    pip.write_text(
        f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n'
        f"case \"$*\" in *--dry-run*) echo '{json.dumps(report)}' ;; esac\n"
    )
    pip.chmod(0o755)
    script = f"source {SCRIPT}; PIP={pip}; CPU_INDEX={index}; install_torch"
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"}
    out = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, check=True
    )
    calls = (tmp_path / "calls").read_text() if (tmp_path / "calls").exists() else ""
    return out.stdout, calls


def test_without_a_gpu_and_without_the_index_it_falls_back_fast_to_the_local_cpu_wheel(tmp_path):
    start = time.monotonic()
    out, calls = _install_torch(
        tmp_path, has_gpu=False, index=UNREACHABLE, dry_run_version="2.13.0+cpu"
    )
    assert time.monotonic() - start < 10
    assert f"CPU wheel pip finds (2.13.0+cpu {WHEEL_URL})" in out
    assert calls.splitlines()[-1] == "install -q torch==2.13.0"


def test_without_a_cpu_wheel_it_says_it_downloads_the_cuda_build(tmp_path):
    out, _ = _install_torch(tmp_path, has_gpu=False, index=UNREACHABLE, dry_run_version="2.13.0")
    assert "is the CUDA build (~2.5 GB)" in out and "unreachable" in out


def test_with_a_gpu_it_installs_pypis_build_and_says_so(tmp_path):
    out, calls = _install_torch(tmp_path, has_gpu=True, index=UNREACHABLE, dry_run_version="x")
    assert "GPU found" in out and calls.splitlines() == ["install -q torch==2.13.0"]


def test_where_the_cpu_index_answers_it_installs_from_it(tmp_path):
    index = tmp_path / "index"
    (index / "torch").mkdir(parents=True)
    (index / "torch" / "index.html").write_text("<html></html>")
    server = subprocess.Popen(
        [sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1"],
        cwd=index,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = server.stdout.readline().split("port ")[1].split()[0]
        url = f"http://127.0.0.1:{port}"
        out, calls = _install_torch(tmp_path, has_gpu=False, index=url, dry_run_version="x")
    finally:
        server.terminate()
        server.wait()
    assert "the CPU build (~200 MB)" in out
    assert calls.splitlines() == [f"install -q torch==2.13.0 --index-url {url}"]
