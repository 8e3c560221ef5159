"""`agentrl env list` / `agentrl env check ID` (tests for agentrl/cli/env.py)."""

from __future__ import annotations

from typer.testing import CliRunner

from agentrl.cli import app

runner = CliRunner()


def test_env_list_shows_calculator() -> None:
    result = runner.invoke(app, ["env", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert (
        "calculator" in result.output
        and "agentrl.envs.builtin.calculator:CalculatorEnv" in result.output
    )


def test_env_check_passes_calculator() -> None:
    result = runner.invoke(app, ["env", "check", "calculator"])
    assert result.exit_code == 0, result.output
    assert "✓ calculator" in result.output


def test_env_check_fails_with_problems_and_exit_code_1() -> None:
    result = runner.invoke(app, ["env", "check", "no-such-env"], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    assert "✗ no-such-env" in result.output and "unknown env id 'no-such-env'" in result.output
