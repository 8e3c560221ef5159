"""`agentrl sandbox run` refuses bad limits and unreadable programs in one line, before any
sandbox starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from tests.support.cli import one_line

runner = CliRunner()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--memory-mb", "-5"], "--memory-mb=-5 must be > 0; e.g. --memory-mb 512"),
        (["--memory-mb", "0"], "--memory-mb=0 must be > 0"),
        (["--timeout-s", "0"], "--timeout-s=0 must be a finite number > 0"),
        (["--timeout-s", "-1"], "--timeout-s=-1 must be a finite number > 0"),
        (["--timeout-s", "nan"], "--timeout-s=nan must be a finite number > 0"),
        (["--timeout-s", "inf"], "--timeout-s=inf must be a finite number > 0"),
    ],
)
def test_a_bad_limit_is_one_error_line(tmp_path: Path, flags: list[str], named: str) -> None:
    program = tmp_path / "prog.py"
    program.write_text("print(1)\n")
    result = runner.invoke(app, ["sandbox", "run", str(program), *flags])
    assert result.exit_code == 2, result.output
    assert named in one_line(result.output, prefix="error: ")


def test_a_program_that_is_not_utf8_is_one_error_line(tmp_path: Path) -> None:
    program = tmp_path / "prog.py"
    program.write_bytes(b"\xff\xfeprint(1)\n")
    result = runner.invoke(app, ["sandbox", "run", str(program)])
    assert result.exit_code == 2, result.output
    line = one_line(result.output, prefix="error: ")
    assert str(program) in line and "not UTF-8" in line and "0xff" in line
