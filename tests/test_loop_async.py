"""Asynchronous training end to end on the `slow_tools` env (long-tailed tool latency) with a
tiny random model on CPU: both async modes complete their steps, no trained trajectory is past
the staleness bound, every turn records its policy version, and episodes that span a weight
update finish and are trained on."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.config import ConfigError, recipe_for_env
from agentrl.rollout.staleness import trajectory_lag
from agentrl.run import train
from agentrl.trainer.sampling_mask import truncate_logits
from agentrl.types import EpisodeStatus, read_jsonl


def _config(model_path: str, save: Path, mode: str | None):
    cfg = recipe_for_env("slow_tools")
    cfg.model.path, cfg.checkpoint.save = model_path, str(save)
    cfg.env.kwargs = {"num_turns": 3, "median_latency_s": 0.05, "latency_sigma": 1.0}
    cfg.train.num_rollout, cfg.train.lr = 5, 1e-2
    cfg.algo.entropy_coef = 1e-3  # every step trains, even a batch whose groups tie on reward
    cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt = 2, 2
    cfg.rollout.rollout_max_response_len, cfg.rollout.max_turns = 8, 3
    cfg.eval.num_eval_tasks, cfg.eval.eval_at_start = 2, False
    cfg.checkpoint.save_interval = 100
    cfg.log.progress, cfg.log.use_tensorboard = False, False
    if mode is not None:
        cfg.train.use_async, cfg.train.async_mode = True, mode
    return cfg


def _trained(run_dir: Path) -> dict[int, list]:
    """Trajectories trained at each trainer version (the step file's number minus one)."""
    files = sorted((run_dir / "rollouts").glob("step_*.jsonl"))
    return {int(f.stem.split("_")[1]) - 1: read_jsonl(str(f)) for f in files}


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step", "full"])
def test_async_modes_train_within_the_staleness_bound(tiny_model_path, tmp_path, mode):
    cfg = _config(tiny_model_path, tmp_path / mode, mode)
    cfg.train.max_staleness = 1 if mode == "one_step" else 2
    result = train(cfg)
    assert result.num_steps == 5
    trained = _trained(tmp_path / mode)
    assert sorted(trained) == [0, 1, 2, 3, 4]
    for version, trajs in trained.items():
        assert trajs
        for t in trajs:
            assert t.turns and all(isinstance(turn.weight_version, int) for turn in t.turns)
            assert trajectory_lag(t, version) <= cfg.train.max_staleness
    rows = _metrics(tmp_path / mode)
    assert len(rows) == 5
    for row in rows:  # the pace metrics of every step
        for key in ("perf/trainer_idle_frac", "perf/engine_idle_frac", "rollout/queue_depth",
                    "rollout/episodes_in_flight", "rollout/num_stale_dropped",
                    "train/tis_weight_mean"):  # fmt: skip
            assert key in row, (key, row)
        assert any(k.startswith("rollout/staleness_hist/") for k in row)
    assert any("offpolicy/logprob_abs_diff/lag_1" in r for r in rows)  # TIS on by default
    assert json.loads((tmp_path / mode / "run_config.json").read_text())["algo"]["use_tis"]


@pytest.mark.slow
def test_full_async_episodes_span_weight_updates_and_are_trained(tiny_model_path, tmp_path):
    cfg = _config(tiny_model_path, tmp_path / "run", "full")
    cfg.env.kwargs["median_latency_s"] = 0.2  # tool calls outlast a train step
    cfg.train.max_staleness = 4
    cfg.train.num_episodes_in_flight = 8
    train(cfg)
    spanning = [
        t
        for trajs in _trained(tmp_path / "run").values()
        for t in trajs
        if len({turn.weight_version for turn in t.turns}) > 1
    ]
    assert spanning, "no trained episode spanned a weight update"
    assert all(t.status == EpisodeStatus.COMPLETED for t in spanning)  # none aborted
    for t in spanning:  # each turn kept the version it was sampled with, in order
        versions = [int(turn.weight_version) for turn in t.turns]
        assert versions == sorted(versions)


def test_async_settings_that_cannot_work_are_refused_by_name(tmp_path):
    cfg = _config("unused", tmp_path, "full")
    cfg.cluster.colocate = True
    with pytest.raises(ConfigError, match="--colocate"):
        train(cfg)
    cfg = _config("unused", tmp_path, None)
    cfg.train.async_mode = "full"
    with pytest.raises(ConfigError, match="use_async"):
        train(cfg)
    cfg = _config("unused", tmp_path, "one_step")
    cfg.train.update_weights_interval, cfg.train.max_staleness = 3, 2
    with pytest.raises(ConfigError, match="--max-staleness=2"):
        train(cfg)


@pytest.mark.slow
def test_updates_landing_mid_turn_keep_each_tokens_version(tiny_model_path, tmp_path, monkeypatch):
    """Issue 42: no trajectory is trained with a token older than the staleness bound, over a
    full-async run whose weight updates land while turns are being generated. The runtime's gate
    normally drains running turns first; here it does not (as an SGLang server updated in place
    would not), and while the trainer steps the engine holds once a turn has sampled a token, so
    the update lands inside that turn."""
    from agentrl.deploy.runtime import Runtime
    from agentrl.engine.gate import GatedEngine
    from agentrl.engine.local.engine import LocalEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32)
    # version -> weights; named_parameters: a tied lm_head is not there to undo its embedding
    weights = {0: {k: v.detach().clone() for k, v in model.named_parameters()}}
    sent: dict[str, torch.Tensor] = {}  # an update's buckets so far
    is_training = [False]

    @contextlib.asynccontextmanager
    async def no_drain(self):
        yield

    async def train_step(self, batches, step=Runtime.train_step):
        is_training[0] = True
        return await step(self, batches)

    def step_or_hold(self, step=LocalEngine._step):
        running = [s for s in self._scheduler.running if not s.is_cancelled]
        if is_training[0] and not self._commands and any(s.output_ids for s in running):
            self._wake.wait()  # until the update's command (or a new request) comes
            return
        step(self)

    def kept(self, updates, version, apply=LocalEngine._apply_weights):
        sent.update({n: t.detach().clone() for n, t in updates})
        if version != self.weight_version:  # the last bucket: the update is whole
            weights[version] = {**weights[max(weights)], **sent}
            sent.clear()
            is_training[0] = False
        apply(self, updates, version)

    monkeypatch.setattr(GatedEngine, "paused", no_drain)
    monkeypatch.setattr(Runtime, "train_step", train_step)
    monkeypatch.setattr(LocalEngine, "_step", step_or_hold)
    monkeypatch.setattr(LocalEngine, "_apply_weights", kept)
    cfg = _config(tiny_model_path, tmp_path / "run", "full")
    cfg.env.kwargs["median_latency_s"] = 0.01
    cfg.rollout.rollout_top_k = 20  # the trainer replays the filter (sampling-mask replay)
    cfg.train.num_rollout, cfg.train.max_staleness = 4, 1
    cfg.train.num_episodes_in_flight = 8
    train(cfg)
    straddling = []
    for version, trajs in _trained(tmp_path / "run").items():
        for t in trajs:
            token_versions = [v for turn in t.turns for v in turn.token_versions()]
            assert min(token_versions) >= version - cfg.train.max_staleness, (version, t.turns)
            straddling += [(t, turn) for turn in t.turns if len(turn.version_spans) > 1]
    assert straddling, "no trained turn straddled a weight update"
    for traj, turn in straddling[:4]:
        versions = [v for v, _ in turn.version_spans]
        assert versions == sorted(versions)
        recorded = torch.tensor(_turn_logprobs(traj, turn))
        by_version = {v: _teacher_forced(model, weights[v], traj, turn) for v in versions}
        start = 0
        for version, n in turn.version_spans:  # each span is its own version's, not the other's
            ours = by_version[version][start : start + n]
            torch.testing.assert_close(recorded[start : start + n], ours, atol=2e-3, rtol=0)
            others = [by_version[v][start : start + n] for v in versions if v != version]
            assert all((o - recorded[start : start + n]).abs().max() > 1e-2 for o in others)
            start += n


def _turn_logprobs(traj, turn) -> list[float]:
    before = sum(traj.loss_mask[: turn.start])
    return traj.logprobs[before : before + turn.num_sampled]


@torch.no_grad()
def _teacher_forced(model, state: dict[str, torch.Tensor], traj, turn) -> torch.Tensor:
    """The turn's logprobs under the weights `state`, with its top-k replayed."""
    model.load_state_dict(state, strict=False)
    end = turn.start + turn.num_sampled
    ids = torch.tensor([traj.token_ids[:end]])
    logits = model(ids).logits[0, turn.start - 1 : end - 1].float() / turn.temperature
    targets = ids[0, turn.start :]
    n = len(targets)
    logits = truncate_logits(
        logits, targets, torch.full((n,), turn.top_k), torch.full((n,), turn.top_p)
    )
    return torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
