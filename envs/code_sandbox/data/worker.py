"""Untrusted side of grading: imports the solution and answers calls, one JSON line each.

It never sees the tests or the nonce. Whatever the solution does to this process (exit,
patch builtins, print) can only spoil its own answers.
"""

import json
import os
import sys

from codec import decode, encode


def main():
    entry_point = sys.argv[1]
    proto = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the solution's prints must not mix with the protocol

    def send(msg):
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    namespace = {"__name__": "solution"}
    try:
        with open("solution.py") as f:
            exec(compile(f.read(), "solution.py", "exec"), namespace)
        fn = namespace[entry_point]
    except BaseException as e:  # SystemExit at import included: it earns nothing
        send({"error": f"{type(e).__name__}: {e}"})
        return
    send({"ready": True})
    for line in sys.stdin:
        try:
            args = decode(json.loads(line))
            send({"ok": encode(fn(*args))})
        except BaseException as e:
            send({"error": (f"{type(e).__name__}: {e}")[:1000]})


main()
