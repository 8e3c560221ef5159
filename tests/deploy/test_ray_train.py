"""On a local Ray (CPU worker processes, gloo): `agentrl train` with 2 trainer ranks and 2
`agentrl serve` engines, colocated and disaggregated; engines serve exactly the trainer's weights
after every sync; a server killed mid-rollout is restarted, synced, and its tasks re-run; and no
process is left behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from agentrl.config import RunConfig
from agentrl.types import EpisodeStatus, read_jsonl
from tests.support.configs import tiny_train_config

pytestmark = pytest.mark.slow

LAYOUTS = {
    "colocated": dict(actor_num_gpus_per_node=2, colocate=True),
    "disaggregated": dict(actor_num_gpus_per_node=2, rollout_num_gpus=2),
}


def _config(model_path: str, save: Path, layout: str) -> RunConfig:
    return tiny_train_config(model_path, save, **LAYOUTS[layout])


def _our_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != "zombie"}


async def _server_pids(runtime) -> list[int | None]:
    """The pid of each engine server (its Ray actor's child process)."""
    return [await s.actor.pid.remote() for s in runtime.engines.supervisor.servers]


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.parametrize("layout", ["colocated", "disaggregated"])
def test_train_two_steps_on_two_ranks_and_two_engines(
    tiny_model_path, tmp_path, layout, monkeypatch
):
    from agentrl.run import train

    # The engines start with --api-key; every call of the driver and the ranks carries it.
    monkeypatch.setenv("AGENTRL_API_KEY", f"key-{layout}")
    before = _our_children()
    result = train(_config(tiny_model_path, tmp_path / "run", layout))

    assert result.num_steps == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "train/loss" in r}
    assert sorted(steps) == [1, 2]
    for step, row in steps.items():
        # Token-exact: the trainer's fp32 logprobs of every sampled token equal the engine's.
        assert row["train/logprob_abs_diff"] < 1e-4, (step, row["train/logprob_abs_diff"])
        # After the sync, each engine samples with exactly the trainer's new weights.
        assert row["weight_sync/max_logprob_abs_diff"] < 1e-4, (step, row)
        assert row["weight_sync/bytes"] > 0
        assert row["rollout/num_split_episodes"] == 0  # every turn reached its episode's server
    trajs = read_jsonl(str(tmp_path / "run" / "rollouts" / "step_000002.jsonl"))
    assert {t.turns[0].weight_version for t in trajs} == {1}  # step 2 sampled the synced policy
    # Episodes spread over both servers, each episode on one (its routing key's).
    both = trajs + read_jsonl(str(tmp_path / "run" / "rollouts" / "step_000001.jsonl"))
    assert all(len({turn.served_by for turn in t.turns}) == 1 for t in both)
    assert len({t.turns[0].served_by for t in both}) == 2
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    assert (ckpt / "config.json").exists() and any(ckpt.glob("*.safetensors"))  # the HF copy
    assert not _alive(_our_children() - before), "a worker or server outlived the run"
    if layout == "colocated":
        _resume_in_one_process_reproduces_step_two(tiny_model_path, tmp_path, steps[2])


def _resume_in_one_process_reproduces_step_two(model_path: str, tmp_path: Path, ray_step2: dict):
    """The 2-rank sharded checkpoint of step 1 resumes in one process (1 rank, no Ray) and step 2
    has the same data and loss: checkpoints do not depend on the number of ranks."""
    import shutil

    from agentrl.run import train

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "run" / "checkpoints" / "step_000001", resumed / "checkpoints" / "step_000001"
    )
    cfg = _config(model_path, resumed, "colocated")
    cfg.cluster.use_ray = False
    cfg.checkpoint.resume = str(resumed)
    train(cfg)
    rows = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    (step2,) = [r for r in rows if "train/loss" in r and r["step"] == 2]
    assert step2["train/loss"] == pytest.approx(ray_step2["train/loss"], rel=1e-4, abs=1e-6)
    a = read_jsonl(str(tmp_path / "run" / "rollouts" / "step_000002.jsonl"))
    b = read_jsonl(str(resumed / "rollouts" / "step_000002.jsonl"))
    assert [t.token_ids for t in a] == [t.token_ids for t in b]


def test_a_killed_engine_is_restarted_synced_and_its_tasks_rerun(tiny_model_path, tmp_path):
    from agentrl.data import TaskSource, load_tasks
    from agentrl.deploy.launch import start_on_ray
    from agentrl.envs import spec
    from agentrl.rollout import build_runner
    from agentrl.rollout.collect import collect_groups

    cfg = _config(tiny_model_path, tmp_path / "run", "disaggregated")
    cfg.rollout.rollout_batch_size = 4
    cfg.rollout.rollout_max_response_len = 48
    before = _our_children()

    async def scenario() -> None:
        runtime = await start_on_ray(cfg, tiny_model_path, num_optimizer_steps=1)
        try:
            await runtime.sync_weights(1)
            runner = build_runner(cfg, runtime.engine)
            source = TaskSource(load_tasks(cfg.env, "train", spec(cfg.env.id).load_class()), seed=0)
            (victim,) = (await _server_pids(runtime))[:1]
            rollout = asyncio.ensure_future(
                collect_groups(
                    runner,
                    source,
                    cfg.rollout,
                    seed_for_round=lambda r: r,
                    heal=runtime.heal_engines,
                )  # fmt: skip
            )
            while not runtime.engine.num_running:  # episodes are in flight
                await asyncio.sleep(0.01)
            os.kill(victim, signal.SIGKILL)
            collected = await rollout

            assert collected.num_engine_restarts == 1 and collected.num_engine_reruns >= 1
            assert len(collected.groups) == 4
            statuses = {t.status for g in collected.groups for t in g}
            assert EpisodeStatus.ABORTED not in statuses
            new_pid = (await _server_pids(runtime))[0]
            assert new_pid != victim and runtime.engines.supervisor.num_restarts == [1, 0]
            # The restarted server was brought to the policy's weights and version.
            assert await runtime.served_weights_gap(1) < 1e-4
        finally:
            await runtime.close()

    asyncio.run(scenario())
    assert not _alive(_our_children() - before), "a worker or server outlived the run"


DRIVER = """
import asyncio, json, sys
import ray
from agentrl.deploy.launch import start_on_ray
from agentrl.config import RunConfig

cfg = RunConfig.from_dict(json.loads(sys.argv[1]))

async def main():
    runtime = await start_on_ray(cfg, cfg.model.path, num_optimizer_steps=1)
    try:
        await runtime.sync_weights(1)
        gap = await runtime.served_weights_gap(1)
        pids = [await s.actor.pid.remote() for s in runtime.engines.supervisor.servers]
    finally:
        await runtime.close()
    print(json.dumps({"gap": gap, "pids": pids, "connected": ray.is_initialized()}))

asyncio.run(main())
"""


def test_ray_address_joins_a_running_cluster_and_leaves_it_running(
    tiny_model_path, tmp_path, monkeypatch
):
    """`--ray-address`: a fresh driver places its actors on an existing cluster (`ray start
    --head`) and on close removes its own actors and servers but not the cluster."""
    import subprocess
    import sys

    from agentrl.deploy.processes import free_ports

    (port,) = free_ports(1)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a throwaway loopback cluster, no token
    env = dict(os.environ)
    start = [
        "ray",
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=4",
        "--include-dashboard=false",
    ]
    subprocess.run(start, check=True, capture_output=True, timeout=120, env=env)
    try:
        cfg = _config(tiny_model_path, tmp_path / "run", "colocated")
        cfg.cluster.actor_num_gpus_per_node = 1
        cfg.cluster.ray_address = f"127.0.0.1:{port}"
        driver = subprocess.run(
            [sys.executable, "-c", DRIVER, json.dumps(cfg.to_dict())],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert driver.returncode == 0, driver.stderr[-3000:]
        out = json.loads(driver.stdout.strip().splitlines()[-1])
        assert out["gap"] < 1e-4 and not out["connected"]
        assert not _alive({p for p in out["pids"] if p})
        status = subprocess.run(["ray", "status", f"--address=127.0.0.1:{port}"], env=env)
        assert status.returncode == 0  # the cluster still runs: it was joined, not started
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=120, env=env)


def test_async_trains_on_one_step_old_rollouts_and_syncs_between_generations(
    tiny_model_path, tmp_path
):
    """--async (slime's train_async.py): step k+1's rollout runs while step k trains, with the
    weights of version k; weights change only between generations; staleness stays <= 1."""
    from agentrl.run import train

    cfg = _config(tiny_model_path, tmp_path / "run", "disaggregated")
    cfg.train.num_rollout = 3
    cfg.train.use_async = True
    result = train(cfg)

    assert result.num_steps == 3
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "train/loss" in r}
    assert [steps[s]["rollout/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    versions = {
        s: {
            t.turns[0].weight_version
            for t in read_jsonl(str(tmp_path / "run" / "rollouts" / f"step_{s:06d}.jsonl"))
        }
        for s in (1, 2, 3)
    }
    assert versions == {1: {0}, 2: {0}, 3: {1}}  # step 3 was generated after sync 1
    for s in (1, 2, 3):  # every sync still leaves each engine on exactly the trainer's weights
        assert steps[s]["weight_sync/max_logprob_abs_diff"] < 1e-4


def test_async_is_refused_when_colocated_or_in_one_process(tiny_model_path, tmp_path):
    from agentrl.config import ConfigError
    from agentrl.run import train

    cfg = _config(tiny_model_path, tmp_path / "run", "colocated")
    cfg.train.use_async = True
    with pytest.raises(ConfigError, match="--async .* without --colocate"):
        train(cfg)
    cfg.cluster = type(cfg.cluster)()  # no placement flags: one process, on CUDA (colocated)
    cfg.model.device = "cuda"
    with pytest.raises(ConfigError, match="disaggregated"):
        train(cfg)
    assert not (tmp_path / "run" / "rollouts").exists()  # refused before anything was written


def test_disk_transport_loads_a_full_model_dir_on_every_engine(tiny_model_path, tmp_path):
    """--update-weight-transport disk: rank 0 writes the weights (and the model's config and
    tokenizer, which SGLang loads too) and every engine loads them with update_weights_from_disk."""
    from agentrl.deploy.launch import start_on_ray

    cfg = _config(tiny_model_path, tmp_path / "run", "disaggregated")
    cfg.cluster.update_weight_transport = "disk"

    async def scenario() -> None:
        runtime = await start_on_ray(cfg, tiny_model_path, num_optimizer_steps=1)
        try:
            out = await runtime.sync_weights(7)
            assert out["weight_sync/bytes"] > 0
            assert await runtime.served_weights_gap(7) < 1e-4
        finally:
            await runtime.close()

    asyncio.run(scenario())


def test_full_async_on_ray_keeps_episodes_running_across_syncs(tiny_model_path, tmp_path):
    """--async-mode full, disaggregated: the rollout worker runs through the syncs (the engine
    gate drains turns, the servers pause with retract), nothing trained is past the bound."""
    from agentrl.run import train

    cfg = _config(tiny_model_path, tmp_path / "run", "disaggregated")
    cfg.train.num_rollout, cfg.train.max_staleness = 3, 2
    cfg.train.use_async, cfg.train.async_mode = True, "full"
    assert train(cfg).num_steps == 3
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 3 and all(r["rollout/staleness_max"] <= 2 for r in steps)
    assert all(r["weight_sync/max_logprob_abs_diff"] < 1e-4 for r in steps)
