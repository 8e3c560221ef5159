"""A user's env that is broken fails in one line, never a traceback and never an exit 0: an env
module that raises on import, a `load_tasks` that raises, a `reset` that raises every time."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from tests.support.cli import one_line

ENV = """
from agentrl.envs import AgentEnv, StepResult
from agentrl.types import Message, Task


class Broken(AgentEnv):
    reward_range = (0.0, 1.0)

    @classmethod
    def load_tasks(cls, split, **kwargs):
        if MODE == "load_tasks":
            return {}["x"]
        return [Task(id="t1", data={"q": "hi"}, split=split)]

    async def reset(self, *, seed=None, options=None):
        if MODE == "reset":
            1 / 0
        return [Message(role="user", content="hi")], {}

    async def step(self, action):
        return StepResult(reward=1.0, terminated=True)
"""


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def write(mode: str, prefix: str = "") -> str:
        name = f"broken_{mode}"
        (tmp_path / f"{name}.py").write_text(f"MODE = {mode!r}\n{prefix}\n{ENV}")
        return f"{name}:Broken"

    yield write
    for name in [m for m in sys.modules if m.startswith("broken_")]:
        sys.modules.pop(name)


@pytest.mark.parametrize(
    ("prefix", "named"),
    [("x = (", "SyntaxError"), ("raise RuntimeError('boom')", "RuntimeError: boom")],
)
def test_an_env_module_that_raises_on_import_is_one_line(env_module, prefix, named):
    env = env_module("import", prefix)
    result = CliRunner().invoke(app, ["eval", "--env", env, "--model", "unused", "--out", "out"])
    assert result.exit_code == 2, result.output
    line = one_line(result.output, prefix="error:")
    assert f"importing 'broken_import' raised {named}" in line and "fix the module" in line


def test_a_load_tasks_that_raises_is_one_line(env_module):
    env = env_module("load_tasks")
    result = CliRunner().invoke(app, ["eval", "--env", env, "--model", "unused", "--out", "out"])
    assert result.exit_code == 2, result.output
    line = one_line(result.output, prefix="error:")
    assert "its load_tasks raised KeyError: 'x'" in line


@pytest.mark.slow
def test_an_eval_whose_every_episode_errored_exits_non_zero(env_module, tiny_model_path):
    """It exited 0 with a table of n/a; the table still prints, then one line says why."""
    env = env_module("reset")
    args = ["eval", "--env", env, "--model", tiny_model_path, "--out", "out", "--num-tasks", "1"]
    result = CliRunner().invoke(app, [*args, "--set", "log.progress=false"])
    assert result.exit_code == 1, result.output
    assert "all 1 episodes failed (env: 1), so none was scored" in result.output
