from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from tests.support.cli import one_line

runner = CliRunner()


def test_slime_flags_map_to_config():
    result = runner.invoke(
        app,
        [
            "train",
            "--env",
            "calculator",
            "--rollout-batch-size",
            "3",
            "--n-samples-per-prompt",
            "6",
            "--advantage-estimator",
            "rloo",
            "--use-kl-loss",
            "--kl-loss-coef",
            "0.01",
            "--eps-clip-high",
            "0.28",
            "--lr",
            "2e-6",
            "--save",
            "/tmp/x",
            "--set",
            "rollout.max_turns=2",
            "--show-config",
        ],
    )
    assert result.exit_code == 0, result.output
    cfg = json.loads(result.stdout)  # notes go to stderr
    assert cfg["rollout"]["rollout_batch_size"] == 3
    assert cfg["rollout"]["n_samples_per_prompt"] == 6
    assert cfg["algo"]["advantage_estimator"] == "rloo"
    assert cfg["algo"]["use_kl_loss"] is True and cfg["algo"]["kl_loss_coef"] == 0.01
    assert cfg["algo"]["eps_clip_high"] == 0.28
    assert cfg["train"]["lr"] == 2e-6
    assert cfg["checkpoint"]["save"] == "/tmp/x"
    assert cfg["rollout"]["max_turns"] == 2


def test_every_slime_flag_names_one_config_field():
    """A flag sets the field of its name: a name two sections share would be ambiguous."""
    from agentrl.cli.train import train_command
    from agentrl.cli.train_flags import COMMAND_FLAGS, RENAMED_FLAGS, config_key
    from agentrl.config import RunConfig

    cfg = RunConfig()
    sections = [f.name for f in dataclasses.fields(cfg)]
    for flag in inspect.signature(train_command).parameters:
        if flag in COMMAND_FLAGS:
            continue
        owners = [s for s in sections if hasattr(getattr(cfg, s), flag)]
        assert flag in RENAMED_FLAGS or len(owners) == 1, (flag, owners)
        section, name = config_key(flag).split(".")
        assert hasattr(getattr(cfg, section), name), flag
    assert config_key("eps_clip") == "algo.eps_clip" and config_key("model") == "model.path"


def test_every_config_flag_reaches_the_config(monkeypatch):
    """The command lists its config flags by name (it captured `locals()`): a flag left out of
    that list would be accepted and then ignored."""
    from agentrl.cli import train
    from agentrl.cli.train_flags import COMMAND_FLAGS

    seen: dict[str, object] = {}

    def capture(env, flags, *args, **kwargs):
        seen.update(flags)
        raise SystemExit(0)

    monkeypatch.setattr(train, "build_config", capture)
    runner.invoke(app, ["train", "--show-config"])
    params = set(inspect.signature(train.train_command).parameters) - set(COMMAND_FLAGS)
    assert set(seen) == params


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train", "--context-parallel-size", "2"], "No such option: --context-parallel-size"),
        (["train", "--lr", "abc"], "Invalid value for '--lr': Input should be a valid number"),
        (["train", "--num-rollout=x"], "(got 'x'); see agentrl train --help"),
        (["train", "--hf-checkpoint"], "Option '--hf-checkpoint' requires an argument"),
        (["eval"], "Missing option '--env'; see agentrl eval --help"),
        (["rollout", "--num-tasks", "x"], "Invalid value for '--num-tasks'"),
        (["show"], "Missing argument 'path'"),
        (["env", "check", "calculator", "--seed", "s"], "Invalid value for '--seed'"),
    ],
)
def test_a_usage_error_is_one_line(args, expected):
    """An unknown flag or a value of the wrong type printed typer's boxed usage block."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert expected in one_line(result.output, prefix="error:")


def test_megatron_flags_map_to_the_train_section():
    flags = ["--train-backend", "megatron", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "2", "--sequence-parallel",
             "--recompute-granularity", "full", "--max-tokens-per-gpu", "8192",
             "--micro-batch-size", "4", "--use-distributed-optimizer"]  # fmt: skip
    result = runner.invoke(app, ["train", *flags, "--show-config"])
    assert result.exit_code == 0, result.output
    train = json.loads(result.output)["train"]
    assert train["backend"] == "megatron" and train["tensor_model_parallel_size"] == 2
    assert train["pipeline_model_parallel_size"] == 2 and train["sequence_parallel"] is True
    assert train["recompute_granularity"] == "full" and train["max_tokens_per_micro_batch"] == 8192
    assert train["use_distributed_optimizer"] is True and train["micro_batch_size"] == 4


def test_placement_flags_map_to_the_cluster_section():
    flags = ["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4",
             "--rollout-num-gpus-per-engine", "2", "--colocate", "--ray-address", "head:6379",
             "--update-weight-transport", "disk", "--offload-train"]  # fmt: skip
    result = runner.invoke(app, ["train", *flags, "--show-config"])
    assert result.exit_code == 0, result.output
    cluster = json.loads(result.output)["cluster"]
    assert cluster["actor_num_nodes"] == 2 and cluster["actor_num_gpus_per_node"] == 4
    assert cluster["rollout_num_gpus"] == 4 and cluster["rollout_num_gpus_per_engine"] == 2
    assert cluster["colocate"] is True and cluster["ray_address"] == "head:6379"
    assert cluster["update_weight_transport"] == "disk" and cluster["offload_train"] is True


def test_placement_help_is_grouped():
    result = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    assert "Placement (Ray" in result.output and "--rollout-num-gpus-per-engine" in result.output


def test_bad_set_names_field():
    result = runner.invoke(app, ["train", "--set", "train.nope=1", "--show-config"])
    assert result.exit_code == 2
    assert "train.nope" in result.output


def test_bad_prompt_data_row_is_named_before_any_model_loads(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"question": "Who wrote Hamlet?", "golden_answers": ["Shakespeare"]}\n{"question": "Capital of France?"}\n'
    )
    result = runner.invoke(
        app,
        ["train", "--env", "search_r1", "--prompt-data", str(bad), "--save", str(tmp_path / "run")],
    )
    assert result.exit_code == 2, result.output
    assert "row 1" in result.output and "golden_answers" in result.output
    assert str(bad) in result.output.replace("\n", "")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--env", "nope"], "unknown env id 'nope'"),
        # square brackets in a message are text, not rich markup
        (["--env", "nope"], 'in your package\'s [project.entry-points."agentrl.envs"] table'),
        # an env argument the env does not take: named with its value and what the env takes
        (["--set", "env.kwargs.max_turnz=3"], "env.kwargs.max_turnz=3: CalculatorEnv"),
        # a value the env's constructor refuses: a traceback at the first episode, the model
        # loaded and a run dir left behind
        (
            ["--set", "env.kwargs.format_weight=2"],
            "env 'calculator': CalculatorEnv refused its arguments (env.kwargs): format_weight=2",
        ),
        (["--model", "/does/not/exist"], "model path '/does/not/exist'"),
        # without megatron-core (CI) or CUDA (here) the error says which and names the fix
        (["--train-backend", "megatron"], "use --train-backend torch"),
        # out-of-range numbers are config errors before anything loads (these crashed with a
        # ZeroDivisionError, a backend traceback, or ran while ignoring the flag)
        (["--rollout-batch-size", "0"], "rollout.rollout_batch_size=0 is out of range: it must"),
        (["--lr", "-1"], "train.lr=-1.0 is out of range: it must be greater than or equal to 0"),
        (["--actor-num-gpus-per-node", "0"], "cluster.actor_num_gpus_per_node=0 is out of"),
        # two values for one field: --set used to win without a word
        (
            ["--lr", "1e-5", "--set", "train.lr=2e-5"],
            "train.lr is given twice: 1e-05 by its flag and 2e-05 by --set train.lr=2e-5; keep "
            "one of them",
        ),
        # slime refuses it too: the last optimizer step of every train step would be short
        (
            [
                "--rollout-batch-size",
                "3",
                "--n-samples-per-prompt",
                "4",
                "--global-batch-size",
                "5",
            ],
            "--global-batch-size=5 does not divide --rollout-batch-size x --n-samples-per-prompt "
            "= 3 x 4 = 12 trajectories; use a divisor of 12 (e.g. 4 or 6)",
        ),
    ],
)
def test_a_user_error_is_one_line_and_writes_nothing(tmp_path, flags, named):
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["train", *flags, "--save", str(run_dir)])
    assert result.exit_code == 2, result.output
    assert named in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1
    assert not run_dir.exists()


def test_a_set_that_agrees_with_its_flag_is_fine():
    result = runner.invoke(
        app, ["train", "--lr", "1e-5", "--set", "train.lr=0.00001", "--show-config"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["train"]["lr"] == 1e-5


def test_a_binary_prompt_data_file_is_one_line(tmp_path):
    """A gzip file given as JSONL was a UnicodeDecodeError traceback."""
    import gzip

    data = tmp_path / "tasks.jsonl"
    data.write_bytes(gzip.compress(b'{"question": "1+1?", "answer": "2"}\n'))
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["train", "--prompt-data", str(data), "--save", str(run_dir)])
    assert result.exit_code == 2, result.output
    line = one_line(result.output, prefix="error:")
    assert "tasks.jsonl:1: binary data, not UTF-8 text (byte 0x8b at column 2)" in line
    assert not run_dir.exists()


def help_entries(output: str) -> dict[str, str]:
    """`--help`'s options, by their names column, with their help text joined into one line."""
    entries: dict[str, str] = {}
    names = None
    for line in output.split("\nOptions:\n", 1)[1].splitlines():  # after the description
        if line.startswith("  -"):
            names, _, text = line.strip().partition("  ")
            entries[names] = text.strip()
        elif line.startswith("   ") and names is not None:
            entries[names] = f"{entries[names]} {line.strip()}".strip()
        else:
            names = None
    return entries


def test_help_at_80_columns_shows_every_flag_whole_with_help_and_default():
    """Rich's table cut names at 80 columns (`--n-samples-per-pro…`); half the flags had no help
    and none said its default."""
    import re

    import typer

    from agentrl.cli.train_flags import COMMAND_FLAGS

    result = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0 and "…" not in result.output, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    entries = help_entries(result.output)
    command = typer.main.get_command(app).commands["train"]
    for param in command.params:
        for name in (*param.opts, *param.secondary_opts):
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", result.output), name
        (text,) = [t for names, t in entries.items() if param.opts[0] in re.split("[ ,/]+", names)]
        assert text, param.opts
        if param.name not in (*COMMAND_FLAGS, "help"):
            assert "default" in text, (param.opts, text)
    (batch_size,) = [text for names, text in entries.items() if "--rollout-batch-size " in names]
    assert "(default: 8)" in batch_size  # the calculator recipe's


def test_a_config_error_is_told_before_torch_loads():
    """Config errors took 3.5 s: `agentrl.run` imported the loop, and torch with it, before a
    value was checked. A fresh interpreter refuses `--set train.lr=-1` with torch unloaded."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from agentrl.cli import app\n"
        "r = CliRunner().invoke(app, ['train', '--env', 'calculator', '--set', 'train.lr=-1'])\n"
        "assert r.exit_code == 2 and 'train.lr' in r.output, r.output\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
