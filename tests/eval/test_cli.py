"""`agentrl eval`: config from flags, checkpoint resolution, and a full run whose engine,
data and rollout are fakes (the test is about the command, not about inference)."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from agentrl.cli.eval import build_config, checkpoint_model_dir, register
from agentrl.config import ConfigError

from .conftest import FakeRunner, make_tasks


def test_build_config_applies_flags_then_overrides(tmp_path) -> None:
    data = tmp_path / "tasks.jsonl"
    data.write_text("{}\n")
    cfg = build_config(
        "calculator",
        data=data,
        model="m",
        k=4,
        num_tasks=5,
        temperature=0.3,
        overrides=["eval.num_eval_tasks=5", "rollout.max_turns=2"],
    )
    assert (cfg.env.id, cfg.env.eval_data, cfg.model.path) == ("calculator", str(data), "m")
    assert (cfg.eval.n_samples, cfg.eval.num_eval_tasks, cfg.eval.temperature) == (4, 5, 0.3)
    assert cfg.rollout.max_turns == 2
    # a --set that contradicts a flag is refused, as in train
    with pytest.raises(ConfigError, match="eval.num_eval_tasks is given twice: 5 by its flag"):
        build_config("calculator", num_tasks=5, overrides=["eval.num_eval_tasks=7"])


def test_a_data_file_is_evaluated_whole_unless_num_tasks_says_fewer(tmp_path) -> None:
    """The recipe's eval.num_eval_tasks (64 for search_r1) caps the env's own split, never a
    file the user passed: `eval --data FILE` used to evaluate its first 64 rows silently."""
    data = tmp_path / "tasks.jsonl"
    data.write_text("{}\n")
    assert build_config("search_r1").eval.num_eval_tasks == 64
    assert build_config("search_r1", data=data).eval.num_eval_tasks is None
    assert build_config("search_r1", data=data, num_tasks=5).eval.num_eval_tasks == 5
    capped = build_config("search_r1", data=data, overrides=["eval.num_eval_tasks=9"])
    assert capped.eval.num_eval_tasks == 9


def test_build_config_errors_name_the_problem(tmp_path) -> None:
    with pytest.raises(ValueError, match="--checkpoint and --model"):
        build_config("calculator", checkpoint=tmp_path, model="m")
    with pytest.raises(FileNotFoundError, match="--data .*missing.jsonl does not exist"):
        build_config("calculator", data=tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="unknown field 'eval.bogus'"):
        build_config("calculator", overrides=["eval.bogus=1"])
    with pytest.raises(ConfigError, match="eval.n_samples=0 is out of range: it must be greater"):
        build_config("calculator", k=0)


def test_checkpoint_uses_its_model_subdirectory(tmp_path) -> None:
    assert checkpoint_model_dir(tmp_path) == tmp_path
    (tmp_path / "model").mkdir()
    assert checkpoint_model_dir(tmp_path) == tmp_path / "model"
    assert build_config("calculator", checkpoint=tmp_path).model.path == str(tmp_path / "model")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        checkpoint_model_dir(tmp_path / "nope")


class FakeEngine:
    is_closed = False

    async def close(self) -> None:
        self.is_closed = True


@pytest.fixture
def fakes(monkeypatch):
    """Fake data, engine and rollout runner behind the names the command imports."""
    seen: dict = {"runners": []}

    def load_tasks(env_cfg, split, env_cls):
        seen["load"] = (env_cfg.id, split)
        return make_tasks(4)

    def make_engine(cfg):
        seen["model_path"] = cfg.model.path
        seen["engine"] = FakeEngine()
        return seen["engine"]

    def build_runner(cfg, engine):
        seen["runners"].append(FakeRunner())
        return seen["runners"][-1]

    monkeypatch.setattr("agentrl.data.load_tasks", load_tasks)
    monkeypatch.setattr("agentrl.engine.factory.make_engine", make_engine)
    monkeypatch.setattr("agentrl.rollout.build_runner", build_runner)
    return seen


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:  # keeps `eval` a named subcommand
        pass

    register(app)
    return app


def test_eval_command_runs_writes_reports_and_resumes(fakes, tmp_path) -> None:
    out = tmp_path / "out"
    args = [
        "eval",
        "--env",
        "calculator",
        "-k",
        "2",
        "--num-tasks",
        "3",
        "--out",
        str(out),
        "--temperature",
        "0.5",
        "--set",
        "log.progress=false",
    ]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, result.output
    assert fakes["load"] == ("calculator", "test") and fakes["engine"].is_closed
    assert fakes["runners"][0].run_task_ids == [["t0", "t1", "t2"]]
    assert "pass@2" in result.output and "maj@2" in result.output
    report = json.loads((out / "report.json").read_text())
    assert (report["num_tasks"], report["k"], report["temperature"]) == (3, 2, 0.5)
    assert (out / "report.png").exists() and (out / "report.md").exists()

    args[args.index("3")] = "4"  # one more task: only it runs
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, result.output
    assert fakes["runners"][1].run_task_ids == [["t3"]]


def test_eval_command_refuses_to_resume_another_setting(fakes, tmp_path) -> None:
    args = ["eval", "--env", "calculator", "-k", "1", "--num-tasks", "1", "--out", str(tmp_path)]
    assert CliRunner().invoke(_app(), [*args, "--set", "log.progress=false"]).exit_code == 0
    result = CliRunner().invoke(
        _app(), [*args, "--temperature", "0.9", "--set", "log.progress=false"]
    )
    assert result.exit_code == 2
    assert "--no-resume" in result.output
    rerun = [*args, "--temperature", "0.9", "--no-resume", "--set", "log.progress=false"]
    assert CliRunner().invoke(_app(), rerun).exit_code == 0


def test_eval_command_reports_bad_flags_without_a_traceback(fakes, tmp_path) -> None:
    result = CliRunner().invoke(
        _app(), ["eval", "--env", "calculator", "--set", "eval.n_samples=zero"]
    )
    assert result.exit_code == 2
    assert "eval.n_samples='zero' is not an integer" in result.output


@pytest.mark.parametrize("is_run_dir", [True, False])
def test_eval_of_a_checkpoint_says_which_step_it_evaluates(fakes, tmp_path, is_run_dir) -> None:
    """`--checkpoint RUN_DIR` picked the newest checkpoint without saying which."""
    for step in ("step_000001", "step_000002"):
        (tmp_path / "run" / "checkpoints" / step / "model").mkdir(parents=True)
        (tmp_path / "run" / "checkpoints" / step / "model" / "config.json").write_text("{}")
    newest = tmp_path / "run" / "checkpoints" / "step_000002"
    given = tmp_path / "run" if is_run_dir else newest
    args = [
        "eval",
        "--env",
        "calculator",
        "--checkpoint",
        str(given),
        "-k",
        "1",
        "--num-tasks",
        "1",
    ]
    result = CliRunner().invoke(_app(), [*args, "--set", "log.progress=false"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"evaluating step 2 ({newest / 'model'})\n")
    assert fakes["model_path"] == str(newest / "model")


def test_checkpoint_accepts_a_run_dir_and_picks_the_newest_checkpoint(tmp_path) -> None:
    for step in ("step_000001", "step_000002"):
        (tmp_path / "checkpoints" / step).mkdir(parents=True)
        (tmp_path / "checkpoints" / step / "config.json").write_text("{}")
    (tmp_path / "checkpoints" / "latest").write_text("step_000002")
    (tmp_path / "run_config.json").write_text("{}")
    newest = tmp_path / "checkpoints" / "step_000002"
    assert checkpoint_model_dir(tmp_path) == newest
    assert checkpoint_model_dir(tmp_path / "checkpoints") == newest
    assert (
        checkpoint_model_dir(tmp_path / "checkpoints" / "step_000001")
        == tmp_path / "checkpoints" / "step_000001"
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--model", "bogusname"], "model path 'bogusname' is neither"),
        (["--split", "bogus"], "calculator has splits"),
        (["--out", "{tmp}/afile"], "afile is a file; pass a directory"),
        (["--set", "engine.kind=http"], "engine.kind=http needs engine.url"),
    ],
)
def test_a_user_error_is_one_line(tmp_path, flags, named) -> None:
    from agentrl.cli import app
    from tests.support.cli import one_line

    (tmp_path / "afile").write_text("x")
    args = ["eval", "--env", "calculator", *(f.format(tmp=tmp_path) for f in flags)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert named in one_line(result.output)


def test_an_eval_whose_episodes_all_aborted_exits_non_zero_and_says_why(
    fakes, tmp_path, monkeypatch
) -> None:
    """It exited 0 with a table of n/a (issue 39)."""
    from agentrl.types import EpisodeStatus
    from tests.support.cli import one_line

    from .conftest import build_traj

    aborted = FakeRunner(lambda task, i: build_traj(status=EpisodeStatus.ABORTED))
    monkeypatch.setattr("agentrl.rollout.build_runner", lambda cfg, engine: aborted)
    args = ["eval", "--env", "calculator", "-k", "2", "--num-tasks", "3", "--out", str(tmp_path)]
    result = CliRunner().invoke(
        _app(), [*args, "--temperature", "1", "--set", "log.progress=false"]
    )
    assert result.exit_code == 1, result.output
    line = one_line(result.output, prefix="error: all 6 episodes were ABORTED (cancelled: 6): ")
    assert "the local engine stopped answering or aborted them, so none was scored" in line
