"""`agentrl train --resume` of a run directory someone else made: a pickle planted in any file a
resume reads is refused in one line and never runs; a copy resumes in the copy and leaves every
byte of the original as it was. A bad `--agent` fails in one line before any run dir exists."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.run.run_dir import check_writable
from agentrl.trainer.checkpoint_safety import read_dcp_metadata
from tests.support.cli import one_line

runner = CliRunner()
# One step; the random model's groups tie, and an entropy term still steps the optimizer, so
# the checkpoint holds optimizer state (DCP's non-tensor items among it).
TINY_RUN = [
    *("--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
    *("--rollout-max-response-len", "8", "--set", "algo.entropy_coef=0.001"),
    *("--set", "eval.eval_at_start=false", "--set", "eval.num_eval_tasks=2"),
    *("--set", "log.progress=false", "--set", "log.use_tensorboard=false"),
]


@pytest.fixture(scope="module")
def finished_run(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step run of the tiny model, as `agentrl train` leaves it; copy it before use."""
    run = tmp_path_factory.mktemp("finished") / "run"
    result = runner.invoke(
        app, ["train", "--model", tiny_model_path, "--save", str(run), *TINY_RUN]
    )
    assert result.exit_code == 0, result.output
    return run


class _Marker:
    """Unpickling it creates `path`: the proof that a load ran code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _plant_in_dcp_item(sharded: Path, marker: Path) -> None:
    """Rewrite the DCP checkpoint with the same keys, every non-tensor item (the optimizer's
    param_groups: what the loader reads) the marker; tensors as they were shaped."""
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    metadata = read_dcp_metadata(sharded)
    assert any(isinstance(i, BytesStorageMetadata) for i in metadata.state_dict_metadata.values())
    state = {
        key: torch.zeros(item.size, dtype=item.properties.dtype)
        if isinstance(item, TensorStorageMetadata)
        else _Marker(marker)
        for key, item in metadata.state_dict_metadata.items()
    }
    shutil.rmtree(sharded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state_dict_saver.save(state, checkpoint_id=str(sharded), no_dist=True)


def _plant(step: Path, target: str, marker: Path) -> None:
    payload = pickle.dumps(_Marker(marker))
    if target == "loop_state.json":
        (step / "loop_state.json").write_bytes(payload)
    elif target == "loop_state.pt":  # a checkpoint saved before the loop state was JSON
        (step / "loop_state.json").unlink()
        torch.save({"step": 1, "data": {}, "rng": _Marker(marker)}, step / "loop_state.pt")
    elif target == "scheduler.pt":
        buf = io.BytesIO()
        torch.save(_Marker(marker), buf)
        (step / "scheduler.pt").write_bytes(buf.getvalue())
    elif target == "sharded/.metadata":
        (step / "sharded" / ".metadata").write_bytes(payload)
    else:
        _plant_in_dcp_item(step / "sharded", marker)


@pytest.mark.slow
@pytest.mark.parametrize(
    "target",
    ["loop_state.json", "loop_state.pt", "scheduler.pt", "sharded/.metadata", "sharded item"],
)
def test_a_pickle_planted_in_a_checkpoint_never_runs(finished_run, tmp_path, target):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    marker = tmp_path / "marker"
    _plant(run / "checkpoints" / "step_000001", target, marker)
    assert not marker.exists()
    before = _checksums(run)

    result = runner.invoke(app, ["train", "--resume", str(run), "--override", "--num-rollout", "2"])

    assert result.exit_code == 2, result.output
    # above it: the override and the note that the copy trains in itself
    line = one_line(result.output.split("error:", 1)[1], prefix=" ")
    assert "step_000001" in line, line
    assert not marker.exists(), "the planted pickle ran"
    assert _checksums(run) == before  # refused before anything was written


def test_the_dcp_metadata_and_item_checks_refuse_without_a_run(tmp_path):
    """The same refusals at the trainer's own load (no CLI in front): the metadata reader and
    the planner of `load_sharded`."""
    from agentrl.trainer.checkpoint_safety import UnsafeCheckpointError, check_dcp_dir
    from agentrl.trainer.sharded_checkpoint import load_sharded

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    from agentrl.trainer.sharded_checkpoint import save_sharded

    save_sharded(tmp_path, model, optimizer)
    load_sharded(tmp_path, model, optimizer)  # a real one loads
    marker = tmp_path / "marker"
    _plant_in_dcp_item(tmp_path / "sharded", marker)
    with pytest.raises(UnsafeCheckpointError, match="optimizer.param_groups"):
        check_dcp_dir(tmp_path / "sharded")
    with pytest.raises(UnsafeCheckpointError, match="optimizer.param_groups"):
        load_sharded(tmp_path, model, optimizer)
    (tmp_path / "sharded" / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    with pytest.raises(UnsafeCheckpointError, match="posix.system, not a DCP metadata class"):
        load_sharded(tmp_path, model, optimizer)
    assert not marker.exists()


def _checksums(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_resuming_a_copy_trains_in_the_copy_and_leaves_the_original(finished_run, tmp_path):
    """`cp -r a b; agentrl train --resume b`: b's run_config.json names a; b trains (a notice
    says so), a keeps every byte, mtimes of its files too."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(finished_run, a)
    saved = json.loads((a / "run_config.json").read_text())
    saved["checkpoint"]["save"] = str(a)  # as a run in `a` wrote it
    (a / "run_config.json").write_text(json.dumps(saved))
    shutil.copytree(a, b)
    before = _checksums(a)
    mtimes = {p: p.stat().st_mtime_ns for p in a.rglob("*")}

    result = runner.invoke(
        app, ["train", "--resume", str(b), "--override", "--num-rollout", "2"],
        env={"COLUMNS": "300"},
    )  # fmt: skip

    assert result.exit_code == 0, result.output
    assert f"names checkpoint.save={str(a)!r}; this run trains in {str(b)!r}" in result.output
    assert _checksums(a) == before
    assert {p: p.stat().st_mtime_ns for p in a.rglob("*")} == mtimes
    assert (b / "checkpoints" / "step_000002").is_dir()
    assert json.loads((b / "run_config.json").read_text())["checkpoint"]["save"] == str(b)
    rows = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]


BAD_AGENTS = {
    "no_module": ("nosuch_agent_module:run", "No module named 'nosuch_agent_module'"),
    "no_attribute": ("tests.agents.conftest:nosuch", "nosuch"),
    "not_async": ("json:dumps", "not an `async def run(task, client)`"),
    "raises_on_import": ("raising_agent:run", "importing it raised RuntimeError: agent boom"),
}


@pytest.mark.parametrize("case", list(BAD_AGENTS))
def test_a_bad_agent_is_one_line_before_any_run_dir(tmp_path, monkeypatch, case):
    agent, named = BAD_AGENTS[case]
    monkeypatch.chdir(tmp_path)  # where an agent module is imported from
    (tmp_path / "raising_agent.py").write_text("raise RuntimeError('agent\\nboom')\n")
    run = tmp_path / "run"
    result = runner.invoke(
        app, ["train", "--agent", agent, "--model", "unused", "--save", str(run)]
    )
    assert result.exit_code == 2, result.output
    line = one_line(result.output, prefix="error:")
    assert f"rollout.agent={agent!r}" in line and named in line, line
    assert not run.exists()
    check_writable(run, is_resume=False, is_overwrite=False)  # the next run is not blocked


@pytest.mark.parametrize("case", ["no_module", "not_async"])
def test_eval_with_a_bad_agent_is_one_line_before_the_model_loads(tmp_path, monkeypatch, case):
    agent, named = BAD_AGENTS[case]
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "eval"
    result = runner.invoke(
        app,
        ["eval", "--env", "calculator", "--agent", agent, "--model", "unused", "--out", str(out)],
    )
    assert result.exit_code == 2, result.output
    line = one_line(result.output, prefix="error:")
    assert f"rollout.agent={agent!r}" in line and named in line, line
    assert not out.exists()


@pytest.mark.slow
def test_resuming_a_finished_run_says_so_and_loads_nothing(finished_run, tmp_path, monkeypatch):
    """It loaded the model and the checkpoint, then found nothing to do."""
    import agentrl.run.loop

    def no_load(*args, **kwargs):
        raise AssertionError("a finished run loaded its model")

    monkeypatch.setattr(agentrl.run.loop, "make_runtime", no_load)
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = _checksums(run)
    result = runner.invoke(app, ["train", "--resume", str(run)])
    assert result.exit_code == 0, result.output
    line = one_line(result.stdout)
    assert line == (
        f"{run} is finished: step 1 of 1 trained, saved and evaluated; nothing to do (to train "
        f"more: agentrl train --resume {run} --override --num-rollout N)"
    )
    assert _checksums(run) == before
