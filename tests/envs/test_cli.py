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


def test_env_check_of_a_dead_url_is_one_line_naming_it() -> None:
    """A URL where nothing listens listed 4 side effects (load_tasks twice, reset twice); it is
    one problem naming the URL and how to start a server there."""
    from agentrl.deploy.processes import free_ports

    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    result = runner.invoke(app, ["env", "check", url], env={"COLUMNS": "80"})
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"✗ {url}: env server {url}: nothing answered GET /info")
    assert "agentrl env serve" in lines[0]
