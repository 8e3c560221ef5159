"""Your own data for your own env (issue 39): README's CapitalsEnv, copied here, trained and
evaluated on a JSONL file reaches `reset` with each row's data; a mistake is one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from tests.support.cli import forget_my_env

# README's env with its `task_from_row` (issue 39's README block), plus a record of what `reset`
# saw (in a file: the env registry keeps the class a first test loaded).
README_ENV = '''
# my_env.py
from __future__ import annotations

import json

from agentrl.envs import AgentEnv, StepResult, register
from agentrl.tools import tool
from agentrl.types import Message, Task


@tool(timeout_s=5)
def lookup_capital(country: str) -> str:
    """Look up the capital city of a country.

    Args:
        country: The country's English name.
    """
    return {"france": "Paris", "japan": "Tokyo", "kenya": "Nairobi"}.get(country.lower(), "unknown")


class CapitalsEnv(AgentEnv):
    reward_range = (0.0, 1.0)

    def __init__(self) -> None:
        super().__init__()
        self.tools.register(lookup_capital)   # the model sees this tool's schema

    @classmethod
    def load_tasks(cls, split: str, **kwargs) -> list[Task]:   # the env's own tasks
        countries = ["France", "Japan", "Kenya"]
        return [Task(id=f"{split}-{c}", data={"country": c}, split=split) for c in countries]

    @classmethod
    def task_from_row(cls, row, *, index, input_key=None, label_key=None) -> Task:
        # one row of your own file (--prompt-data, eval --data); without this method a row's
        # fields land in task.data as they are
        key = input_key or "country"
        if not isinstance(row.get(key), str):
            raise ValueError(f"row {index}: field {key!r} must be a country's name")
        return Task(id=str(row.get("id", f"row-{index}")), data={"country": row[key]})

    async def reset(self, *, seed=None, options=None):
        self.task = options["task"]
        with open("seen.jsonl", "a") as f:  # added by the test: what reset saw
            f.write(json.dumps([self.task.id, self.task.data]) + "\\n")
        question = f"What is the capital of {self.task.data['country']}? Answer in one word."
        return [Message(role="user", content=question)], {}

    async def step(self, action: Message) -> StepResult:
        if action.tool_calls:                  # run the tools; errors come back as messages
            results = await self.call_tools(action)
            return StepResult(observation=[r.message for r in results],
                              info={"num_tool_calls": len(results),
                                    "num_tool_errors": sum(r.is_error for r in results)})
        truth = lookup_capital.fn(self.task.data["country"])
        return StepResult(reward=float(truth.lower() in action.content.lower()), terminated=True)


class NoRowsEnv(CapitalsEnv):  # added by the test: the env as a newcomer first writes it
    load_tasks = vars(AgentEnv)["load_tasks"]  # the classmethods themselves, unbound
    task_from_row = vars(AgentEnv)["task_from_row"]


register("capitals", entry_point=CapitalsEnv, description="Name a country's capital.")
'''

TINY = [
    "--set",
    "rollout.max_turns=1",
    "--set",
    "rollout.rollout_max_response_len=4",
    "--set",
    "log.progress=false",
]
ROWS = [{"id": "fr", "country": "France"}, {"id": "ke", "country": "Kenya"}]


@pytest.fixture
def env_dir(tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text(README_ENV)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    forget_my_env()


def _seen() -> dict[str, dict]:
    return dict(json.loads(line) for line in open("seen.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("env", ["my_env:CapitalsEnv", "my_env:NoRowsEnv"])
def test_eval_on_a_data_file_resets_with_each_rows_data(env_dir, tiny_model_path, env):
    args = ["eval", "--env", env, "--data", "rows.jsonl", "--model", tiny_model_path, "-k", "1"]
    result = CliRunner().invoke(app, [*args, "--out", "out", *TINY])
    assert result.exit_code == 0, result.output
    seen = _seen()
    assert seen["fr"]["country"] == "France" and seen["ke"]["country"] == "Kenya"


@pytest.mark.slow
def test_train_on_a_data_file_resets_with_its_rows(env_dir, tiny_model_path):
    args = [
        "train",
        "--env",
        "my_env:NoRowsEnv",
        "--prompt-data",
        "rows.jsonl",
        "--set",
        "env.eval_data=rows.jsonl",
        "--model",
        tiny_model_path,
        "--num-rollout",
        "1",
        "--rollout-batch-size",
        "1",
        "--n-samples-per-prompt",
        "2",
        "--save",
        "run",
        "--set",
        "eval.eval_at_start=false",
        "--set",
        "log.use_tensorboard=false",
    ]
    result = CliRunner().invoke(app, [*args, *TINY])
    assert result.exit_code == 0, result.output
    assert {data["country"] for data in _seen().values()} <= {"France", "Kenya"} and _seen()


def test_an_env_without_tasks_names_the_data_flags_in_one_line(env_dir):
    result = CliRunner().invoke(app, ["eval", "--env", "my_env:NoRowsEnv", *TINY])
    assert result.exit_code == 2 and "Traceback" not in result.output
    (line,) = result.output.strip().splitlines()
    assert "NoRowsEnv ships no tasks" in line and "--data FILE" in line


def test_a_missing_input_key_is_one_line_naming_the_field_and_the_method(env_dir):
    args = ["eval", "--env", "my_env:NoRowsEnv", "--data", "rows.jsonl"]
    result = CliRunner().invoke(app, [*args, "--set", "env.input_key=question", *TINY])
    assert result.exit_code == 2 and "Traceback" not in result.output
    (line,) = result.output.strip().splitlines()
    assert "row 0: no field 'question'" in line and "NoRowsEnv.task_from_row" in line
