"""End-to-end smoke test of `train(config)`: 2 steps on a tiny random model, checkpoints,
and a resumed run that reproduces the next step's data and loss exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agentrl.config import recipe_for_env
from agentrl.run import train
from agentrl.types import read_jsonl
from tests.support.configs import tiny_train_config


def _config(model_path: str, save: Path):
    cfg = tiny_train_config(model_path, save, entropy_coef=0.0)  # reward alone: ties are skipped
    cfg.checkpoint.keep_last = 3
    return cfg


def _lora_config(model_path: str, save: Path):
    """`_config` training a rank-4 LoRA adapter, with an entropy term so the random model's
    groups (no reward) still move it."""
    cfg = tiny_train_config(model_path, save)
    cfg.checkpoint.keep_last = 3
    cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.lr = 4, 8, 1e-2
    return cfg


def _resume_step_two(
    model_path: str, run_a: Path, run_b: Path, make_config=_config
) -> tuple[list, list]:
    """Run step 2 again in `run_b`, resumed from `run_a`'s step-1 checkpoint; step 2's
    trajectories of both runs."""
    (run_b / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_a / "checkpoints" / "step_000001", run_b / "checkpoints" / "step_000001")
    cfg_b = make_config(model_path, run_b)
    cfg_b.checkpoint.resume = str(run_b)
    train(cfg_b)
    return tuple(read_jsonl(str(r / "rollouts" / "step_000002.jsonl")) for r in (run_a, run_b))


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return {r["step"]: r for r in rows if "train/loss" in r}


@pytest.mark.slow
def test_train_two_steps_then_resume_reproduces_step_two(tiny_model_path, tmp_path):
    run_a = tmp_path / "a"
    result = train(_config(tiny_model_path, run_a))
    assert result.num_steps == 2
    ckpts = sorted(p.name for p in (run_a / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_000001", "step_000002"]
    # Each checkpoint holds an HF copy that transformers loads as a model (what eval reads).
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run_a / "checkpoints" / "step_000002") is not None
    assert result.evals and result.evals[-1]["step"] == 2

    # Resume from the step-1 checkpoint in a fresh run dir: step 2 must be the same.
    run_b = tmp_path / "b"
    traj_a, traj_b = _resume_step_two(tiny_model_path, run_a, run_b)
    assert [t.task["id"] for t in traj_a] == [t.task["id"] for t in traj_b]
    assert [t.token_ids for t in traj_a] == [t.token_ids for t in traj_b]
    assert _metrics(run_b)[2]["train/loss"] == pytest.approx(
        _metrics(run_a)[2]["train/loss"], rel=1e-5, abs=1e-7
    )
    assert not (run_b / "rollouts" / "step_000001.jsonl").exists()


@pytest.mark.slow
def test_a_lora_run_trains_syncs_the_merged_weights_and_resumes(tiny_model_path, tmp_path):
    """Issue 41: `--lora-rank` through `train(config)`: 2 steps, each synced to the embedded
    engine as the adapter alone (its bytes are the sync's), checkpoints that PEFT loads, and a
    resumed step 2 whose episodes and loss equal the first run's (the resumed engine gets the
    checkpoint's adapter)."""
    run_a = tmp_path / "a"
    result = train(_lora_config(tiny_model_path, run_a))
    assert result.num_steps == 2
    metrics = _metrics(run_a)
    for step in (1, 2):
        row = metrics[step]
        assert row["train/skipped_no_signal"] == 0.0  # the adapter trained
        assert 0 < row["weight_sync/adapter_bytes"] == row["weight_sync/bytes"]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = run_a / "checkpoints" / "step_000002"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert isinstance(PeftModel.from_pretrained(base, str(ckpt)), PeftModel)
    assert not (ckpt / "model.safetensors").exists()  # the frozen base is not copied

    run_b = tmp_path / "b"
    traj_a, traj_b = _resume_step_two(tiny_model_path, run_a, run_b, _lora_config)
    assert [t.token_ids for t in traj_a] == [t.token_ids for t in traj_b]
    assert _metrics(run_b)[2]["train/loss"] == pytest.approx(
        metrics[2]["train/loss"], rel=1e-5, abs=1e-7
    )


@pytest.mark.slow
def test_train_through_http_engine_matches_in_process(tiny_model_path, tmp_path):
    """engine.kind=http: rollouts go over real HTTP to `agentrl serve`, weights are pushed
    back after the step, and the trajectories equal the in-process engine's."""
    import asyncio

    import torch

    from agentrl.engine.local import LocalEngine
    from tests.support.servers import start_server_thread

    local_cfg = _config(tiny_model_path, tmp_path / "local")
    local_cfg.train.num_rollout = 1
    train(local_cfg)

    served = LocalEngine.load(tiny_model_path, device="cpu", seed=0)
    thread = start_server_thread(served)
    try:
        http_cfg = _config(tiny_model_path, tmp_path / "http")
        http_cfg.train.num_rollout = 1
        http_cfg.engine.kind = "http"
        http_cfg.engine.url = thread.url
        train(http_cfg)
        assert served.weight_version == 1
        from safetensors.torch import load_file

        ckpt = next((tmp_path / "http" / "checkpoints" / "step_000001").rglob("*.safetensors"))
        trained = load_file(str(ckpt))
        name = next(n for n in trained if n.endswith("embed_tokens.weight"))
        assert torch.equal(served.model.state_dict()[name].cpu(), trained[name])
    finally:
        thread.stop()
        asyncio.run(served.close())

    local = read_jsonl(str(tmp_path / "local" / "rollouts" / "step_000001.jsonl"))
    http = read_jsonl(str(tmp_path / "http" / "rollouts" / "step_000001.jsonl"))
    assert [t.token_ids for t in http] == [t.token_ids for t in local]
    assert [t.loss_mask for t in http] == [t.loss_mask for t in local]
    for a, b in zip(http, local, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("async_mode", "is_dynamic_sampling"), [(None, False), (None, True), ("full", True)]
)
def test_a_step_whose_episodes_all_failed_stops_the_run_in_one_line(
    tiny_model_path, tmp_path, monkeypatch, async_mode, is_dynamic_sampling
):
    """Every episode ABORTED by a dead engine: the run trained 0 tokens and ended in a 319-line
    traceback (issue 39); now it stops before the update, in one line saying how to go on. With
    dynamic sampling the failed groups were dropped as ties and the line said "zero reward
    variance"; in full async mode the step waited for trainable groups without bound."""
    from agentrl.engine.base import EngineUnavailable
    from agentrl.engine.local import LocalEngine
    from agentrl.run.schedules import NothingToTrainError

    async def dead(self, *args, **kwargs):
        raise EngineUnavailable("POST http://h/generate failed after 4 attempts")

    monkeypatch.setattr(LocalEngine, "generate", dead)
    run = tmp_path / "run"
    cfg = _config(tiny_model_path, run)
    cfg.rollout.dynamic_sampling = is_dynamic_sampling
    cfg.rollout.max_sampling_rounds = 0
    if async_mode is not None:
        cfg.train.use_async, cfg.train.async_mode = True, async_mode
    with pytest.raises(NothingToTrainError) as caught:
        train(cfg)
    message = str(caught.value)
    assert message.startswith(
        "step 1: all 4 episodes failed (4 aborted/engine), nothing to train on; first error in "
        "engine.generate: agentrl.engine.base.EngineUnavailable: POST http://h/generate"
    )
    assert message.endswith(f"start over with --save {run} --overwrite") and "\n" not in message
    assert not (run / "rollouts" / "step_000001.jsonl").exists()  # nothing was trained on


def _train_cli(*args: str) -> list[str]:
    import sys

    return [sys.executable, "-m", "agentrl.cli", "train", *args]


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_that_resumes(tiny_model_path, tmp_path):
    """SIGINT during training writes a complete checkpoint of the last finished step, and
    `--resume` from it trains the next step on the tasks the interrupted run had drawn."""
    import signal
    import subprocess
    import time

    from agentrl.trainer.checkpoint import find_latest

    run = tmp_path / "run"
    cmd = _train_cli(
        "--env", "calculator", "--model", tiny_model_path, "--save", str(run),
        "--num-rollout", "200", "--save-interval", "1000", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--set", "eval.eval_at_start=false", "--set", "log.progress=false",
        "--set", "log.use_tensorboard=false",
    )  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not (run / "rollouts" / "step_000002.jsonl").exists():
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "training never reached step 2"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode != 0
    ckpt = find_latest(run / "checkpoints")
    assert ckpt is not None, out
    step = int(ckpt.name.removeprefix("step_"))
    assert step >= 1 and (ckpt / "loop_state.json").exists()
    # said at once, then what is saved, then where it is and how to go on
    said = out.index("Ctrl-C: stopping; a rollout under way is dropped, an update finishes…")
    saving = out.index("saving step ")
    assert said < saving < out.index(f"saved in {ckpt}")
    assert f"saving step {step} (the last completed)" in out
    assert step in _metrics(run)  # the saved step's metrics line is there
    assert f"saved in {ckpt}" in out.replace("\n", "") and f"--resume {run}" in out

    # Resumed, the next step trains on the tasks that follow the checkpoint's in the seeded order.
    from agentrl.data import TaskSource, load_tasks
    from agentrl.envs import spec

    recipe = recipe_for_env("calculator")
    order = TaskSource(
        load_tasks(recipe.env, "train", spec(recipe.env.id).load_class()), seed=recipe.rollout.seed
    )
    order.next_batch(2 * step)  # the checkpointed steps' tasks (2 per step)
    expected = [t.id for t in order.next_batch(2)]
    resume = _train_cli(
        "--resume", str(run), "--override", "--num-rollout", str(step + 1),
        "--set", "eval.num_eval_tasks=2",
    )  # fmt: skip
    done = subprocess.run(resume, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert find_latest(run / "checkpoints") == run / "checkpoints" / f"step_{step + 1:06d}"
    assert "train/loss" in _metrics(run)[step + 1]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, step + 2))  # once each
    resumed = read_jsonl(str(run / "rollouts" / f"step_{step + 1:06d}.jsonl"))
    assert list(dict.fromkeys(t.task["id"] for t in resumed)) == expected


def test_unbuilt_megatron_backend_is_refused_by_name(tmp_path):
    cfg = _config("unused", tmp_path / "run")
    cfg.train.backend = "megatron"
    with pytest.raises(ValueError, match="train.backend='megatron'"):
        train(cfg)


@pytest.mark.slow
def test_save_interval_minutes_saves_by_clock_and_resumes_exactly(tiny_model_path, tmp_path):
    """save_interval never falls due; a 0-minute clock interval saves after every step, and the
    step-1 checkpoint it wrote replays step 2 exactly."""
    run_a = tmp_path / "a"
    cfg_a = _config(tiny_model_path, run_a)
    cfg_a.checkpoint.save_interval = 1000
    cfg_a.checkpoint.save_interval_minutes = 0.0
    train(cfg_a)
    assert (run_a / "checkpoints" / "step_000001" / "loop_state.json").exists()

    run_b = tmp_path / "b"
    traj_a, traj_b = _resume_step_two(tiny_model_path, run_a, run_b)
    assert [t.task["id"] for t in traj_a] == [t.task["id"] for t in traj_b]
    assert [t.token_ids for t in traj_a] == [t.token_ids for t in traj_b]
    # The restored weights: a wrong weight moves logprobs by far more than 1e-5. Not `==`: the
    # embedded engine batches turns as they arrive, so a decode batch's size (and float32
    # summation order) depends on timing; reruns differ by ~1e-6 (4 of 16 runs did).
    for a, b in zip(traj_a, traj_b, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)

    # The finished run released its lock, and its directory is now refused as a fresh --save.
    from agentrl.run.run_dir import RunDirError

    with pytest.raises(RunDirError, match="--overwrite"):
        train(_config(tiny_model_path, run_a))


class _RecordingState:
    """Stands in for the run's `RunState`: trains instantly and records what `_run` asks for."""

    def __init__(self, cfg, *, interrupt_at: int | None = None) -> None:
        from types import SimpleNamespace

        from agentrl.engine.gate import GatedEngine
        from agentrl.progress import RunProgress

        self.cfg, self.run_dir, self.step, self.interrupt_at = cfg, Path("unused"), 0, interrupt_at
        self.runtime = SimpleNamespace(engine=GatedEngine(None))  # type: ignore[arg-type]
        self.runner = SimpleNamespace(num_episodes_in_flight=0)
        self.logger = SimpleNamespace(log=lambda step, metrics: None)
        self.progress = RunProgress(enabled=False)
        self.evals: list[dict] = []
        self.saves: list[int] = []

    async def collect(self, step: int, *, is_shown: bool = False):
        from agentrl.rollout.collect import Collected
        from agentrl.run.schedules import Rollout
        from tests.eval.conftest import build_traj

        return Rollout(Collected(groups=[[build_traj(1.0)]]), None, 0.0)  # one scored episode

    async def learn(self, step: int, rollout) -> dict:
        if step == self.interrupt_at:
            raise KeyboardInterrupt
        self.step = step + 1
        return {}

    async def sync(self, step: int) -> dict:
        return {}

    async def run_eval(self, step: int) -> dict:
        self.evals.append({"step": step})
        return {}

    async def save(self, step: int) -> Path:
        self.saves.append(step)
        return Path(f"step_{step:06d}")


@pytest.mark.parametrize(
    ("start_step", "eval_interval", "eval_steps", "save_steps"),
    [
        (0, 2, [0, 2, 4, 6, 7], [3, 6, 7]),  # at start, every 2, and the last step once
        (0, None, [0, 7], [3, 6, 7]),
        (2, 2, [4, 6, 7], [3, 6, 7]),  # a resumed run does not evaluate at its start
        (7, 2, [7], [7]),  # nothing left to train: the final eval and save only
    ],
)
async def test_eval_and_save_cadence(start_step, eval_interval, eval_steps, save_steps):
    from agentrl.run.loop import _run

    cfg = _config("unused", Path("unused"))
    cfg.train.num_rollout, cfg.checkpoint.save_interval = 7, 3
    cfg.eval.eval_interval, cfg.eval.eval_at_start = eval_interval, True
    state = _RecordingState(cfg)
    state.step = start_step
    result = await _run(state, start_step)  # type: ignore[arg-type]
    assert [e["step"] for e in state.evals] == eval_steps
    assert state.saves == save_steps
    assert result.num_steps == 7 and result.last_checkpoint == Path("step_000007")


async def test_interrupt_saves_the_last_completed_step_and_stops():
    from agentrl.run.loop import _run

    cfg = _config("unused", Path("unused"))
    cfg.train.num_rollout, cfg.checkpoint.save_interval, cfg.eval.eval_at_start = 7, 3, False
    state = _RecordingState(cfg, interrupt_at=4)  # steps 1-4 done, the 5th interrupted
    with pytest.raises(KeyboardInterrupt):
        await _run(state, 0)  # type: ignore[arg-type]
    assert state.saves == [3, 4] and state.evals == []


async def test_an_eval_of_errored_episodes_is_null_in_the_eval_history(tmp_path, monkeypatch):
    """Every episode of an eval errored: its means are NaN, written as null (valid JSON)."""
    from types import SimpleNamespace

    import agentrl.run.state as run_state

    async def evaluate(*args, **kwargs):
        return SimpleNamespace(summary=lambda: {"reward_mean": float("nan"), "pass_rate": 0.5})

    async def heal_engines() -> int:
        return 0

    monkeypatch.setattr(run_state, "evaluate", evaluate)
    monkeypatch.setattr(run_state, "plot_eval_history", lambda *args, **kwargs: None)
    logger = SimpleNamespace(log=lambda step, metrics: None)
    state = run_state.RunState(
        _config("unused", tmp_path), tmp_path, SimpleNamespace(heal_engines=heal_engines),  # type: ignore[arg-type]
        None, SimpleNamespace(state=lambda: None), [], logger, [],  # type: ignore[arg-type]
    )  # fmt: skip
    await state.run_eval(step=0)
    history = json.loads((tmp_path / "eval_history.json").read_text())
    assert history == [{"step": 0, "reward_mean": None, "pass_rate": 0.5}]
