"""`agentrl export --merge` writes a LoRA checkpoint's adapter merged into its base as a model
transformers loads (bit for bit the trainer's own merged export), and `agentrl eval --checkpoint`
evaluates a LoRA checkpoint (merged on the way, reported under the checkpoint's name)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.config import AlgoConfig, TrainConfig

pytest.importorskip("peft")
runner = CliRunner()


@pytest.fixture(scope="module")
def lora_checkpoint(tiny_model_path, tmp_path_factory):
    """A LoRA checkpoint after one step, and the trainer's own merged export of it."""
    from agentrl.trainer.batch import build_train_batches
    from agentrl.trainer.torch_backend import TorchBackend
    from tests.trainer.conftest import make_groups

    out = tmp_path_factory.mktemp("lora")
    train = TrainConfig(lora_rank=4, lora_alpha=8, lr=5e-2)
    backend = TorchBackend(tiny_model_path, train, AlgoConfig(), device="cpu")
    backend.setup()
    groups = make_groups(num_groups=2, group_size=4, seed=9)
    backend.train_step(
        build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=0)[0]
    )
    backend.save(out / "ckpt")
    backend.export_merged(out / "want")
    return out / "ckpt", out / "want"


def test_export_merge_writes_the_trained_model(lora_checkpoint, tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt, want_dir = lora_checkpoint
    result = runner.invoke(app, ["export", "--merge", str(ckpt), str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).state_dict()
    want = AutoModelForCausalLM.from_pretrained(str(want_dir)).state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert not torch.equal(
        got["model.layers.0.self_attn.q_proj.weight"],
        base["model.layers.0.self_attn.q_proj.weight"],
    )
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()


def test_export_refuses_what_it_cannot_merge_in_one_line(
    lora_checkpoint, tiny_model_path, tmp_path
):
    ckpt, _ = lora_checkpoint
    whole = runner.invoke(app, ["export", "--merge", tiny_model_path, str(tmp_path / "a")])
    assert whole.exit_code == 2 and "holds no LoRA adapter" in whole.output
    assert "Traceback" not in whole.output
    no_flag = runner.invoke(app, ["export", str(ckpt), str(tmp_path / "b")])
    assert no_flag.exit_code == 2 and "pass --merge" in no_flag.output
    missing_base = runner.invoke(
        app, ["export", "--merge", str(ckpt), str(tmp_path / "c"), "--base", str(tmp_path / "gone")]
    )
    assert missing_base.exit_code == 2 and "pass --base PATH" in missing_base.output


@pytest.mark.slow
def test_eval_of_a_lora_checkpoint_runs_on_the_merged_model(lora_checkpoint, tmp_path):
    ckpt, _ = lora_checkpoint
    out = tmp_path / "eval"
    args = ["eval", "--env", "calculator", "--checkpoint", str(ckpt), "--num-tasks", "2", "-k", "1"]
    result = runner.invoke(app, [*args, "--out", str(out), "--set", "rollout.max_turns=1"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["meta"]["model"] == str(ckpt) and report["num_episodes"] == 2
