"""`agentrl train` async flags: --async-mode implies --async; --max-staleness takes none."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from agentrl.cli import app

runner = CliRunner()


def test_async_mode_full_implies_async_and_sets_the_bound():
    flags = ["--async-mode", "full", "--max-staleness", "3", "--num-episodes-in-flight", "12"]
    result = runner.invoke(app, ["train", *flags, "--show-config"])
    assert result.exit_code == 0, result.output
    train = json.loads(result.output)["train"]
    assert train["use_async"] is True and train["async_mode"] == "full"
    assert train["max_staleness"] == 3 and train["num_episodes_in_flight"] == 12


def test_max_staleness_none_turns_the_bound_off_and_a_bad_mode_is_named():
    result = runner.invoke(app, ["train", "--max-staleness", "none", "--show-config"])
    assert json.loads(result.output)["train"]["max_staleness"] is None
    result = runner.invoke(app, ["train", "--async-mode", "fast", "--show-config"])
    assert result.exit_code == 2 and "train.async_mode='fast'" in result.output
