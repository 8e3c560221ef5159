"""`agentrl train` and its run directory: a non-empty --save is refused, one writer at a time,
--resume restores the saved config and refuses changes it was not told to apply."""

from __future__ import annotations

import fcntl
import json
import os

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.config import recipe_for_env
from agentrl.run.run_dir import LOCK_NAME
from tests.support.cli import one_line

runner = CliRunner()


def _saved_run(path, **changes):
    """A run dir as `agentrl train` leaves it: run_config.json (and a checkpoints dir)."""
    cfg = recipe_for_env("slow_tools")
    cfg.checkpoint.save = str(path)
    cfg.rollout.rollout_batch_size = 3
    cfg.train.lr = 2e-5
    (path / "checkpoints").mkdir(parents=True)
    (path / "run_config.json").write_text(json.dumps(cfg.to_dict()))
    return path


def test_an_earlier_run_is_refused_naming_both_fixes(tmp_path, tiny_model_path):
    run = _saved_run(tmp_path / "run")
    (run / "checkpoints" / "step_000001").mkdir()
    result = runner.invoke(app, ["train", "--model", tiny_model_path, "--save", str(run)])
    assert result.exit_code == 2
    line = one_line(result.output)
    assert str(run) in line and f"--resume {run}" in line and "--overwrite" in line
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "run_config.json"]


def test_a_run_that_saved_no_checkpoint_is_not_offered_for_resume(tmp_path, tiny_model_path):
    run = _saved_run(tmp_path / "run")  # it failed before its first checkpoint
    result = runner.invoke(app, ["train", "--model", tiny_model_path, "--save", str(run)])
    assert result.exit_code == 2
    line = one_line(result.output)
    assert "saved no checkpoint" in line and "--overwrite" in line and "--resume" not in line


def test_overwrite_never_clears_a_directory_no_run_wrote(tmp_path, tiny_model_path):
    """--overwrite removes an earlier run's files, not a user's: a directory without
    run_config.json is refused and keeps everything."""
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "precious.txt").write_text("keep me")
    for flags in ([], ["--overwrite"]):
        args = ["train", "--model", tiny_model_path, "--save", str(data), *flags]
        result = runner.invoke(app, args)
        assert result.exit_code == 2
        assert "no agentrl run wrote it" in one_line(result.output)
    assert sorted(p.name for p in data.iterdir()) == ["precious.txt", "sub"]
    assert (data / "precious.txt").read_text() == "keep me"


def test_save_must_be_a_directory_of_its_own(tmp_path, tiny_model_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    for save, named in (("", "is the current directory"), ("afile", "afile is a file"),
                        ("afile/sub", "cannot create it")):  # fmt: skip
        args = ["train", "--model", tiny_model_path, "--save", save, "--overwrite"]
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert named in one_line(result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_second_writer_is_refused_by_the_lock(tmp_path, tiny_model_path):
    run = tmp_path / "run"
    run.mkdir()
    fd = os.open(run / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run, as far as the kernel knows
    try:
        result = runner.invoke(app, ["train", "--model", tiny_model_path, "--save", str(run)])
    finally:
        os.close(fd)
    assert result.exit_code == 2
    line = one_line(result.output)
    assert "another agentrl run is writing" in line and str(run) in line
    assert [p.name for p in run.iterdir()] == [LOCK_NAME]


@pytest.mark.parametrize("flags", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_a_live_run_is_named_first_not_the_advice_for_an_old_one(tmp_path, tiny_model_path, flags):
    """A run dir a live run is writing (run_config.json, a checkpoint, the lock held): the one
    line says another run is writing, not `--resume`/`--overwrite`; nothing is cleared."""
    run = _saved_run(tmp_path / "run")
    (run / "checkpoints" / "step_000001").mkdir()
    fd = os.open(run / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        args = ["train", "--model", tiny_model_path, "--save", str(run), *flags]
        result = runner.invoke(app, args)
    finally:
        os.close(fd)
    assert result.exit_code == 2
    line = one_line(result.output)
    assert "another agentrl run is writing" in line and "--overwrite" not in line, line
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME, "checkpoints", "run_config.json"]


def test_resume_restores_the_saved_env_and_flags(tmp_path):
    run = _saved_run(tmp_path / "run")
    result = runner.invoke(app, ["train", "--resume", str(run), "--show-config"])
    assert result.exit_code == 0, result.output
    cfg = json.loads(result.output)
    assert cfg["env"]["id"] == "slow_tools"  # not the calculator default
    assert cfg["rollout"]["rollout_batch_size"] == 3 and cfg["train"]["lr"] == 2e-5
    assert cfg["checkpoint"]["resume"] == str(run) and cfg["checkpoint"]["save"] == str(run)


def test_resume_refuses_a_changed_flag_with_the_diff_unless_overridden(tmp_path):
    run = _saved_run(tmp_path / "run")
    args = ["train", "--resume", str(run), "--lr", "1e-3", "--env", "calculator"]
    result = runner.invoke(app, [*args, "--show-config"])
    assert result.exit_code == 2
    line = one_line(result.output)
    assert "train.lr: 2e-05 -> 0.001" in line and "env.id: 'slow_tools' -> 'calculator'" in line
    assert "--override" in line

    result = runner.invoke(app, [*args, "--override", "--show-config"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "override train.lr: 2e-05 -> 0.001" in result.output
    assert '"lr": 0.001' in result.output


def test_resume_of_a_missing_dir_isone_line(tmp_path):
    result = runner.invoke(app, ["train", "--resume", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "--resume" in one_line(result.output) and not (tmp_path / "nope").exists()


def test_engine_out_of_room_saves_the_step_and_names_the_fix(tmp_path, tiny_model_path,
                                                             monkeypatch):  # fmt: skip
    """The engines cannot take their memory back after a step: the step is saved, the error is
    one line with the fix, the next line is the resume command; no traceback."""
    from agentrl.deploy.runtime import Runtime
    from agentrl.engine import EngineMemoryError

    async def no_room(self, version):
        raise EngineMemoryError("resuming the engine's kv_cache needs 9.00 GiB; lower it")

    monkeypatch.setattr(Runtime, "sync_weights", no_room)
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", "--model", tiny_model_path, "--save", str(run),
        "--num-rollout", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--set", "eval.eval_at_start=false",
        "--set", "log.progress=false", "--set", "log.use_tensorboard=false"])  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    error, saved = [line for line in result.output.splitlines() if line.strip()][-2:]
    assert error == "error: resuming the engine's kv_cache needs 9.00 GiB; lower it"
    assert "step_000001" in saved and f"agentrl train --resume {run}" in saved
    assert (run / "checkpoints" / "step_000001").is_dir()
    # The printed command is accepted as it is and goes on from the saved step.
    monkeypatch.undo()
    command = saved.split("continue with: ", 1)[1].split()
    assert command[:2] == ["agentrl", "train"] and "--override" in command
    resumed = runner.invoke(app, command[1:])
    assert resumed.exit_code == 0, resumed.output
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if "train/loss" in r) == 3
