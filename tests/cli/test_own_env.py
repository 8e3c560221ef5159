"""README's "Write your own env", copied verbatim into a fresh directory, checks and trains."""

from __future__ import annotations

import re
import shlex

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from tests.conftest import repo_root
from tests.support.cli import forget_my_env

# What keeps one step fast on CPU; every flag of the README's command is kept as written.
TINY = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--set", "rollout.max_turns=2",
        "--set", "eval.num_eval_tasks=1", "--set", "eval.eval_at_start=false",
        "--set", "log.progress=false", "--set", "log.use_tensorboard=false"]  # fmt: skip


def _readme_section() -> str:
    text = (repo_root() / "README.md").read_text()
    return text.split("## Write your own env", 1)[1].split("\n## ", 1)[0]


def _code_and_commands() -> tuple[str, list[list[str]]]:
    section = _readme_section()
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    bash = "".join(re.findall(r"```bash\n(.*?)```", section, re.S))
    return code, [shlex.split(line) for line in bash.splitlines() if line.strip()]


@pytest.fixture
def readme_env_dir(tmp_path, monkeypatch):
    code, _ = _code_and_commands()
    (tmp_path / "my_env.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    forget_my_env()


def test_readme_env_passes_check_env_and_says_so(readme_env_dir, capsys):
    from agentrl.envs import check_env

    checked = check_env("my_env:CapitalsEnv")
    out = capsys.readouterr().out
    assert "passed" in out and len(checked) >= 5
    assert any("load_tasks('train')" in line for line in checked)


@pytest.mark.slow
def test_readme_train_command_trains_one_step(readme_env_dir, tiny_model_path):
    _, commands = _code_and_commands()
    (train,) = [c for c in commands if c[:2] == ["agentrl", "train"]]
    args = [*train[1:], "--num-rollout", "1", "--model", tiny_model_path, *TINY]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Loading weights" not in result.output and "INFO transformers" not in result.output
    save = train[train.index("--save") + 1]
    assert (readme_env_dir / save / "checkpoints" / "step_000001").is_dir()
    assert (readme_env_dir / save / "rollouts" / "step_000001.jsonl").exists()
