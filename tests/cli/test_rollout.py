"""`agentrl rollout` refuses what it cannot do before any model loads, in one line."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from tests.support.cli import one_line

runner = CliRunner()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--out", "{tmp}/no/such/dir/r.jsonl"], "/no/such/dir does not exist"),
        (["--out", "{tmp}"], "is a directory; pass a file path"),
        (["--out", "/dev/null"], "--out /dev/null: is not a regular file"),
        (["--out", "{tmp}/r.jsonl", "--temperature", "-1"], "--temperature=-1.0 must be >= 0"),
        (["--out", "{tmp}/r.jsonl", "--split", "bogus"], "calculator has splits"),
        (["--out", "{tmp}/r.jsonl", "--set", "env.kwargs.bogus=1"], "'bogus'"),
        (["--out", "{tmp}/r.jsonl", "--env", "nope"], "unknown env id 'nope'"),
        (["--out", "{tmp}/r.jsonl", "--model", "/does/not/exist"], "model path '/does/not/exist'"),
        (
            ["--out", "{tmp}/r.jsonl", "--set", "rollout.max_turns=0"],
            "rollout.max_turns='0' is out",
        ),
    ],
)
def test_a_user_error_is_one_line(tmp_path, flags, named):
    args = [a.format(tmp=tmp_path) for a in flags]
    result = runner.invoke(app, ["rollout", "--env", "calculator", *args])
    assert result.exit_code == 2, result.output
    assert named in one_line(result.output)


def test_a_failed_start_leaves_an_existing_out_file_alone(tmp_path):
    out = tmp_path / "earlier.jsonl"
    out.write_text('{"kept": true}\n')
    result = runner.invoke(app, ["rollout", "--env", "nope", "--out", str(out)])
    assert result.exit_code == 2 and "unknown env id" in result.output
    assert out.read_text() == '{"kept": true}\n'
