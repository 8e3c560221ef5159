"""What every bad-input CLI test asserts: the command printed one line and no traceback."""

from __future__ import annotations


def one_line(output: str, *, prefix: str = "") -> str:
    """The single non-blank line of `output` (which starts with `prefix`); fails otherwise."""
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), output
    assert "Traceback" not in output
    return lines[0]
