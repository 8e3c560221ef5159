"""`agentrl env serve` as its own process: the calculator served over HTTP trains and evaluates
as in process (same seed, same tasks, same trajectories), and a server killed mid-step ends
the episodes in flight ERROR/env while the others complete."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentrl.config import recipe_for_env
from agentrl.envs.builtin.calculator import CalculatorEnv
from agentrl.envs.remote import RemoteEnv
from agentrl.types import EpisodeStatus, StatusReason, Task

REPO = Path(__file__).resolve().parents[2]


class HangingCalculator(CalculatorEnv):
    """The calculator, but a task whose question says "hang" never finishes its step."""

    async def step(self, action):
        if "hang" in self.question:
            with open(os.environ["HANG_MARKER"], "a") as f:
                f.write("in step\n")
            await asyncio.sleep(3600)
        return await super().step(action)

    async def reset(self, *, seed=None, options=None):
        self.question = options["task"].data["question"]
        return await super().reset(seed=seed, options=options)


def _serve(env_id: str, log: Path, **env: str) -> tuple[subprocess.Popen, str]:
    from agentrl.deploy.processes import free_ports

    (port,) = free_ports(1)
    cmd = [sys.executable, "-m", "agentrl.cli", "env", "serve", env_id, "--port", str(port)]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, **env}
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(log.read_text())
        time.sleep(0.1)
    raise RuntimeError(f"env server did not start: {log.read_text()}")


def _config(model_path: str, save: Path):
    cfg = recipe_for_env("calculator")
    cfg.model.path = model_path
    cfg.checkpoint.save = str(save)
    cfg.train.num_rollout = 1
    cfg.rollout.rollout_batch_size = 2
    cfg.rollout.n_samples_per_prompt = 2
    cfg.rollout.rollout_max_response_len = 12
    cfg.rollout.max_turns = 2
    cfg.eval.num_eval_tasks = 2
    cfg.eval.eval_at_start = True
    cfg.log.progress = False
    cfg.log.use_tensorboard = False
    return cfg


def _eval_metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if k.startswith("eval/") and "time" not in k and "_s" not in k}
        for r in rows
        if any(k.startswith("eval/") for k in r)
    ]


@pytest.mark.slow
def test_served_calculator_trains_and_evaluates_as_in_process(tiny_model_path, tmp_path):
    from agentrl.run import train
    from agentrl.types import read_jsonl

    train(_config(tiny_model_path, tmp_path / "local"))
    proc, url = _serve("calculator", tmp_path / "server.log")
    try:
        cfg = _config(tiny_model_path, tmp_path / "remote")
        cfg.env.id = "agentrl.envs.remote:RemoteEnv"
        cfg.env.kwargs = {"url": url}
        train(cfg)
    finally:
        proc.terminate()
        proc.wait(30)
    local, remote = (
        read_jsonl(str(tmp_path / r / "rollouts" / "step_000001.jsonl"))
        for r in ("local", "remote")
    )
    assert [t.task["id"] for t in remote] == [t.task["id"] for t in local]
    assert [t.token_ids for t in remote] == [t.token_ids for t in local]
    assert [(t.reward, t.status) for t in remote] == [(t.reward, t.status) for t in local]
    local_eval, remote_eval = _eval_metrics(tmp_path / "local"), _eval_metrics(tmp_path / "remote")
    assert local_eval and remote_eval == local_eval


async def test_killing_the_server_mid_step_errors_those_episodes_only(smollm2_path, tmp_path):
    from agentrl.config import RolloutConfig
    from agentrl.rollout.group import RolloutRunner
    from tests.rollout.conftest import ScriptedEngine, load_tokenizer

    marker = tmp_path / "marker"
    proc, url = _serve(
        "tests.envs.test_remote_server:HangingCalculator",
        tmp_path / "server.log",
        HANG_MARKER=str(marker),
    )
    tokenizer = load_tokenizer(smollm2_path)
    engine = ScriptedEngine(tokenizer, ["<answer>5</answer>"])
    runner = RolloutRunner(
        engine, lambda: RemoteEnv(url), RolloutConfig(max_turns=2), tokenizer=engine.tokenizer
    )
    tasks = [
        Task("fast", {"question": "What is 2 + 3?", "answer": 5}),
        Task("hang", {"question": "hang: what is 2 + 3?", "answer": 5}),
    ]

    async def kill_when_hung() -> None:
        while not (marker.exists() and len(marker.read_text().splitlines()) == 2):
            await asyncio.sleep(0.05)
        while (await asyncio.to_thread(httpx.get, f"{url}/health")).json()["num_sessions"] > 2:
            await asyncio.sleep(0.05)  # the fast episodes have closed their sessions
        proc.kill()

    try:
        killer = asyncio.ensure_future(kill_when_hung())
        fast, hung = await runner.run_groups(tasks, 2)
        await killer
    finally:
        proc.kill()
        proc.wait(30)
    assert [(t.status, t.reward) for t in fast] == [(EpisodeStatus.COMPLETED, 1.0)] * 2
    assert [(t.status, t.status_reason) for t in hung] == [
        (EpisodeStatus.ERROR, StatusReason.ENV)
    ] * 2
    assert all(
        t.info["error_where"] == "env.step" and "RemoteEnvError" in t.info["error"] for t in hung
    )


def test_env_check_of_a_served_env_passes(tmp_path):
    """`agentrl env check http://host:port` failed with "env.tools must be a ToolRegistry, got
    RemoteTools": a served env lists its tools' schemas; the tools run on the server."""
    from agentrl.envs import check_env

    proc, url = _serve("calculator", tmp_path / "server.log")
    try:
        checked = check_env(url)
    finally:
        proc.terminate()
        proc.wait(30)
    assert any("reward_range" in line for line in checked)
    # the schemas come from the server's first session: it reported "0 tool schema(s)"
    assert "1 tool schema(s) are valid JSON schemas" in checked
    assert any("malformed tool call" in line for line in checked)
