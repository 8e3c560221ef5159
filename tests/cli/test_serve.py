"""`agentrl serve` refuses bad values before it binds anything, in one line."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from agentrl.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--model", "/does/not/exist"], "model path '/does/not/exist' is neither"),
        (["--device", "tpu"], "device='tpu' is not a torch device; use auto, cpu, cuda"),
    ],
)
def test_a_bad_value_is_one_error_line(flags, named):
    result = runner.invoke(app, ["serve", *flags])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--port", "99999"], "'--port'"),
        (["--max-batch-size", "0"], "'--max-batch-size'"),
        (["--reserve-gb", "-1"], "'--reserve-gb'"),
    ],
)
def test_an_out_of_range_flag_is_a_usage_error(flags, named):
    result = runner.invoke(app, ["serve", *flags], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert named in result.output and "Traceback" not in result.output
