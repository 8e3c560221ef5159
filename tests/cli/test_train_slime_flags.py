"""slime's flags, their meanings here, and `--config FILE` (issue 39, item 6)."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from tests.support.cli import one_line

runner = CliRunner()


def show_config(*args: str) -> tuple[dict, list[str]]:
    """`agentrl train ARGS --show-config`: the config (stdout), and the notes (stderr)."""
    result = runner.invoke(app, ["train", *args, "--show-config"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), [line for line in result.stderr.splitlines() if line]


def test_slime_flags_set_their_homes(tmp_path):
    cfg, _ = show_config(
        "--hf-checkpoint", str(tmp_path), "--kl-loss-type", "k3", "--entropy-coef", "0.01",
        "--rollout-top-p", "0.9", "--use-wandb", "--eval-prompt-data", "held_out.jsonl",
        "--n-samples-per-eval-prompt", "4", "--eval-temperature", "0.6",
    )  # fmt: skip
    assert cfg["model"]["path"] == str(tmp_path)
    assert cfg["algo"]["kl_loss_type"] == "k3" and cfg["algo"]["entropy_coef"] == 0.01
    assert cfg["rollout"]["rollout_top_p"] == 0.9 and cfg["log"]["use_wandb"] is True
    assert cfg["env"]["eval_data"] == "held_out.jsonl"
    assert cfg["eval"]["n_samples"] == 4 and cfg["eval"]["temperature"] == 0.6


@pytest.mark.parametrize(
    "args",
    [
        ["--eval-prompt-data", "held_out.jsonl"],
        ["--eval-prompt-data", "aime", "held_out.jsonl"],  # slime's NAME PATH pair
        ["--eval-prompt-data", "aime", "held_out.jsonl", "--lr", "1e-6"],
        ["--lr", "1e-6", "--eval-prompt-data", "aime", "held_out.jsonl"],
    ],
)
def test_eval_prompt_data_takes_a_path_or_slimes_name_path_pair(args):
    cfg, _ = show_config(*args)
    assert cfg["env"]["eval_data"] == "held_out.jsonl"


def test_eval_prompt_data_with_two_pairs_is_one_line():
    result = runner.invoke(
        app, ["train", "--eval-prompt-data", "aime", "a.jsonl", "gsm8k", "b.jsonl"]
    )
    assert result.exit_code == 2
    line = one_line(result.output, prefix="error:")
    assert "--eval-prompt-data" in line and "one held-out file" in line and "b.jsonl" in line


@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_gspo_and_cispo_estimators_set_the_policy_loss(loss):
    cfg, notes = show_config("--advantage-estimator", loss)
    assert cfg["algo"]["advantage_estimator"] == "grpo" and cfg["algo"]["policy_loss"] == loss
    assert len(notes) == 1 and f"algo.policy_loss={loss}" in notes[0]


def test_set_gspo_as_estimator_names_the_policy_loss():
    result = runner.invoke(app, ["train", "--set", "algo.advantage_estimator=gspo"])
    assert result.exit_code == 2
    assert "set algo.policy_loss=gspo" in one_line(result.output, prefix="error:")


def test_a_same_named_flag_that_means_more_here_is_noted():
    _, notes = show_config("--rollout-max-response-len", "128")
    assert len(notes) == 1 and "caps each turn here (in slime: the whole response)" in notes[0]


@pytest.mark.parametrize(
    ("args", "is_noted"),
    [
        (["--kl-loss-coef", "0.01"], True),
        (["--set", "algo.kl_loss_coef=0.01"], True),
        (["--kl-loss-coef", "0.01", "--kl-loss-type", "k1"], False),
        (["--lr", "1e-6"], False),
    ],
)
def test_a_kl_coef_without_a_type_notes_slimes_default(args, is_noted):
    _, notes = show_config(*args)
    assert any("slime's default is k1" in note for note in notes) is is_noted


def test_load_of_a_dir_without_a_run_starts_one_and_ref_load_is_noted(tmp_path):
    cfg, notes = show_config("--load", str(tmp_path / "new"), "--ref-load", str(tmp_path))
    assert cfg["checkpoint"]["resume"] is None
    assert any("no agentrl run there yet; starting a new one" in note for note in notes)
    assert any("--ref-load" in note and "is not read" in note for note in notes)


def test_load_of_a_run_dir_resumes_it(tmp_path):
    saved, _ = show_config("--save", str(tmp_path / "run"), "--lr", "3e-6")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run_config.json").write_text(json.dumps(saved))
    cfg, notes = show_config("--load", str(tmp_path / "run"))
    assert cfg["checkpoint"]["resume"] == str(tmp_path / "run") and cfg["train"]["lr"] == 3e-6
    assert notes == []


def test_load_and_resume_together_are_one_line(tmp_path):
    result = runner.invoke(app, ["train", "--load", str(tmp_path), "--resume", str(tmp_path)])
    assert result.exit_code == 2
    assert "pass one of them" in one_line(result.output, prefix="error:")


def test_config_file_sets_fields_under_flags_and_set(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "train.lr: 1e-5\nrollout:\n  n_samples_per_prompt: 6\n  rollout_batch_size: 2\n"
        "env.kwargs.max_turns: 2\n"
    )
    cfg, _ = show_config("--config", str(path), "--rollout-batch-size", "3")
    assert cfg["train"]["lr"] == 1e-5 and cfg["rollout"]["n_samples_per_prompt"] == 6
    assert cfg["rollout"]["rollout_batch_size"] == 3  # the flag wins
    assert cfg["env"]["kwargs"] == {"max_turns": 2}
    cfg, _ = show_config("--config", str(path), "--set", "train.lr=2e-6")
    assert cfg["train"]["lr"] == 2e-6


def test_a_runs_saved_config_is_a_config_file(tmp_path):
    saved, _ = show_config("--rollout-batch-size", "5", "--lr", "3e-6")
    path = tmp_path / "run_config.json"
    path.write_text(json.dumps(saved))
    cfg, _ = show_config("--config", str(path))
    assert cfg == saved


def test_config_files_env_picks_its_recipe(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"env": {"id": "search_r1"}}))
    assert show_config("--config", str(path)) == show_config("--env", "search_r1")


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("train.lr: fast\n", "run.yaml: train.lr='fast' is not a number"),
        ("train.nope: 1\n", "run.yaml: unknown field 'train.nope'; fields of 'train' are:"),
        ("lr: 1e-6\n", "run.yaml: lr: '1e-6' has no section: write train.lr"),
        ("- train.lr\n", "run.yaml: holds a list, not a mapping"),
        ("train: [1\n", "run.yaml: not YAML ("),
        ("algo:\n  advantage_estimator: gspo\n", "set algo.policy_loss=gspo"),
    ],
)
def test_a_bad_config_file_is_one_line_naming_file_and_key(tmp_path, text, named):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    result = runner.invoke(app, ["train", "--config", str(path), "--save", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert named in one_line(result.output, prefix="error:")
    assert not (tmp_path / "r").exists()


def test_a_bad_json_config_and_a_missing_file_are_one_line(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"train.lr": }')
    result = runner.invoke(app, ["train", "--config", str(path)])
    assert "run.json: not JSON (Expecting value at line 1)" in one_line(result.output)
    result = runner.invoke(app, ["train", "--config", str(tmp_path / "gone.json")])
    assert "gone.json: No such file or directory" in one_line(result.output)


def test_yaml_without_pyyaml_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    path = tmp_path / "run.yml"
    path.write_text("train.lr: 1e-6\n")
    result = runner.invoke(app, ["train", "--config", str(path)])
    assert result.exit_code == 2
    assert "reading YAML needs PyYAML; pip install pyyaml" in one_line(result.output)
