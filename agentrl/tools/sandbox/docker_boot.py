"""Runs inside a warm Docker sandbox container for each run (stdlib only, shipped as source).

Reads one length-prefixed JSON payload from stdin. op "run": reset /work and /tmp, write the
files, run the program under rlimits with its output passing straight through, then kill every
process left over (kill(-1) spares only the container's init and ourselves). op "fetch": print
the requested work-dir files as JSON.
"""

import base64
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time


def _reset(dirs):
    for d in dirs:
        for name in os.listdir(d):
            path = os.path.join(d, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass


def _limits(spec):
    def apply():
        os.setsid()
        for which, value in spec:
            resource.setrlimit(which, tuple(value))

    return apply


def _read_payload():
    header = sys.stdin.buffer.readline()
    size = int(header)
    data = sys.stdin.buffer.read(size)
    return json.loads(data)


def read_files(root, names, max_bytes):
    """The regular files `names` under `root`, never read through a symlink the program left (it
    could point at a host file); a missing or odd file is simply absent. The host sandboxes read
    their work dirs with it too (`workdir.py`)."""
    out = {}
    root = os.path.realpath(root)
    for name in names:
        path = os.path.join(root, name)
        if os.path.realpath(path) != os.path.normpath(path):
            continue  # some component is a symlink
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                out[name] = os.read(fd, max_bytes)
        except OSError:
            pass
        finally:
            os.close(fd)
    return out


def _others():
    """Live processes besides init and us (zombies are init's to reap, not ours to kill)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, os.getpid()):
            try:
                with open(f"/proc/{name}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        pids.append(int(name))
            except OSError:
                pass
    return pids


def _kill_all():
    """kill(-1) again until nothing but init and us is left: a fork bomb forks while we kill."""
    for _ in range(500):
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        if not _others():
            return
        time.sleep(0.005)


def _run(payload):
    _kill_all()  # leftovers of a run that killed its own bootstrap
    _reset(["/work", "/tmp"])
    for name, b64 in payload["files"].items():
        path = os.path.join("/work", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(b64))
    proc = subprocess.Popen(
        payload["argv"],
        stdin=subprocess.PIPE,
        cwd="/work",
        env=payload["env"],
        preexec_fn=_limits(payload["rlimits"]),
        close_fds=True,
    )
    stdin = base64.b64decode(payload["stdin"])
    pipe = proc.stdin
    assert pipe is not None  # stdin=PIPE

    def feed():
        try:
            pipe.write(stdin)
            pipe.close()
        except OSError:
            pass

    threading.Thread(target=feed, daemon=True).start()
    rc = proc.wait()
    _kill_all()
    return rc if rc >= 0 else 128 - rc


def main():
    try:
        import ctypes

        ctypes.CDLL(None).prctl(
            4, 0, 0, 0, 0
        )  # PR_SET_DUMPABLE=0: the program cannot read our memory
    except Exception:
        pass
    payload = _read_payload()
    if payload["op"] == "fetch":
        files = read_files("/work", payload["fetch_files"], 1 << 26)
        sys.stdout.write(json.dumps({k: base64.b64encode(v).decode() for k, v in files.items()}))
        sys.stdout.flush()
        os._exit(0)
    os._exit(_run(payload))


if __name__ == "__main__":  # run as `python -c` in the container; imported on the host
    main()
