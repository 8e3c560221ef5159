"""Trusted side of grading (stdlib only): runs the hidden tests in this process and calls the
solution in a separate worker process through typed, serialised values.

stdin (read whole before the worker starts): {"nonce", "prompt", "test", "entry_point",
"call_timeout_s"}. The one result line, printed after every test ran, starts with the nonce,
which exists only in this process's memory (made non-dumpable, so the worker cannot read it).
"""

import ast
import json
import os
import select
import subprocess
import sys

from codec import decode, encode


class CandidateError(Exception):
    pass


class RemoteCandidate:
    """Stands in for the solution's function: each call is a round trip to the worker."""

    def __init__(self, entry_point, timeout_s):
        self.entry_point = entry_point
        self.timeout_s = timeout_s
        self.proc = None
        self.buf = b""

    def _start(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-E", "-s", "worker.py", self.entry_point],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            cwd=os.getcwd(),
            env={"PYTHONDONTWRITEBYTECODE": "1"},
        )
        self.buf = b""
        reply = self._read()
        if "ready" not in reply:
            self._stop()
            raise CandidateError(reply.get("error", "worker did not start"))

    def _stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _read(self):
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            ready, _, _ = select.select([fd], [], [], self.timeout_s)
            chunk = os.read(fd, 1 << 20) if ready else b""
            if not chunk:
                self._stop()
                raise CandidateError("timed out" if not ready else "the solution process exited")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise CandidateError("keyword arguments are not supported")
        if self.proc is None:
            self._start()
        try:
            self.proc.stdin.write((json.dumps(encode(list(args))) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            self._stop()
            raise CandidateError("the solution process exited")
        reply = self._read()
        if "ok" not in reply:
            raise CandidateError(reply.get("error", "no result"))
        return decode(reply["ok"])


def _uses(node, name):
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def run_tests(config):
    """Runs each top-level statement of `check`; a statement that uses the candidate is a test."""
    namespace = {"__name__": "__tests__"}
    exec(compile(config["prompt"], "prompt.py", "exec"), namespace)
    exec(compile(config["test"], "test.py", "exec"), namespace)
    check = next(
        n
        for n in ast.parse(config["test"]).body
        if isinstance(n, ast.FunctionDef) and n.name == "check"
    )
    arg, entry_point = check.args.args[0].arg, config["entry_point"]
    # Tests may call the function by its own name too (HumanEval/33 does): both mean the solution.
    namespace[arg] = namespace[entry_point] = RemoteCandidate(entry_point, config["call_timeout_s"])
    passed = []
    for stmt in check.body:
        code = compile(ast.Module(body=[stmt], type_ignores=[]), "test.py", "exec")
        try:
            exec(code, namespace)
            ok = True
        except BaseException:
            ok = False
        if _uses(stmt, arg) or _uses(stmt, entry_point):
            passed.append(ok)
    namespace[arg]._stop()
    return passed


def main():
    config = json.loads(sys.stdin.read())
    os.close(0)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
    except Exception:
        pass
    nonce = config.pop("nonce")
    passed = run_tests(config)
    sys.stdout.write(f"{nonce} {json.dumps({'passed': passed})}\n")
    sys.stdout.flush()


main()
