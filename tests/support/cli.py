"""What every bad-input CLI test asserts: the command printed one line and no traceback."""

from __future__ import annotations

import sys


def one_line(output: str, *, prefix: str = "") -> str:
    """The single non-blank line of `output` (which starts with `prefix`); fails otherwise."""
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), output
    assert "Traceback" not in output
    return lines[0]


def forget_my_env() -> None:
    """Another test file writes its own my_env.py: its module and the specs registered from it
    (by path, and the id it registers) must not outlive the test."""
    from agentrl.envs import registry

    sys.modules.pop("my_env", None)
    for env_id in [k for k in registry._specs if k.startswith("my_env:") or k == "capitals"]:
        registry._specs.pop(env_id)
