"""A dead `engine.url` stops train, eval and rollout before anything runs: one line naming the URL
and what answered, a non-zero exit, and nothing written (issue 39: train ran a fake run of aborted
episodes and left a run dir that blocked the next one; eval exited 0 with a table of n/a)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from tests.support.cli import one_line
from tests.support.sglang_real import free_port


@pytest.mark.parametrize(
    ("command", "written"),
    [
        (["train", "--save", "{tmp}/run"], "run"),
        (["eval", "--out", "{tmp}/eval"], "eval"),
        (["rollout", "--out", "{tmp}/r.jsonl"], "r.jsonl"),
    ],
)
def test_a_dead_engine_url_is_one_line_and_writes_nothing(tmp_path, command, written) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    args = [command[0], "--env", "calculator", *(a.format(tmp=tmp_path) for a in command[1:])]
    engine = ["--set", "engine.kind=http", "--set", f"engine.url={url}"]
    result = CliRunner().invoke(app, [*args, *engine])
    assert result.exit_code != 0, result.output
    line = one_line(result.output, prefix="error:")
    assert f"engine.url={url}: GET {url}/server_info: connection refused" in line
    assert not (tmp_path / written).exists()
