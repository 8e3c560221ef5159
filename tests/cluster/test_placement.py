"""The placement plan from slime's flags: bundle layout, colocation, and refusals that name the
flags and the numbers before anything starts."""

from __future__ import annotations

import pytest

from agentrl.cluster.placement import check_capacity, plan_placement
from agentrl.config import ClusterConfig, ConfigError, RunConfig
from agentrl.config_checks import check_run


def test_disaggregated_puts_trainer_bundles_first_then_engines():
    cfg = ClusterConfig(
        actor_num_gpus_per_node=2, rollout_num_gpus=4, rollout_num_gpus_per_engine=2
    )
    plan = plan_placement(cfg, use_gpu=True)
    assert plan.num_bundles == 6
    assert plan.trainer_bundles == [0, 1]
    assert plan.engine_bundles == [[2, 3], [4, 5]]
    assert plan.colocated_rank(0) is None
    assert plan.trainer_share == plan.engine_share == 1.0


def test_colocated_engines_share_the_trainer_bundles():
    cfg = ClusterConfig(actor_num_nodes=2, actor_num_gpus_per_node=2, colocate=True)
    plan = plan_placement(cfg, use_gpu=False)
    assert plan.num_bundles == 4
    assert plan.engine_bundles == [[0], [1], [2], [3]]  # rollout GPUs default to the trainer's
    assert [plan.colocated_rank(e) for e in range(4)] == [0, 1, 2, 3]
    assert plan.trainer_share + plan.engine_share <= 1.0


def test_rollout_gpus_must_divide_into_engines():
    cfg = RunConfig(cluster=ClusterConfig(rollout_num_gpus=3, rollout_num_gpus_per_engine=2))
    with pytest.raises(
        ConfigError, match=r"--rollout-num-gpus=3 .*--rollout-num-gpus-per-engine=2"
    ):
        check_run(cfg)


def test_colocated_rollout_cannot_exceed_trainer_gpus():
    cluster = ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=2, colocate=True)
    with pytest.raises(ConfigError, match=r"--rollout-num-gpus=2 > .* = 1"):
        check_run(RunConfig(cluster=cluster))


def test_a_layout_larger_than_the_cluster_is_refused_with_the_numbers():
    cfg = ClusterConfig(actor_num_gpus_per_node=4, rollout_num_gpus=4)
    plan = plan_placement(cfg, use_gpu=True)
    with pytest.raises(ConfigError) as err:
        check_capacity(plan, cfg, available=2)
    message = str(err.value)
    assert "needs 8 GPUs" in message and "trainer 4 + rollout 4" in message
    assert "--actor-num-gpus-per-node=4" in message and "has 2" in message
    check_capacity(plan, cfg, available=8)  # fits: no error


async def test_asking_for_sglang_router_without_it_fails_before_anything_starts(tmp_path):
    import ray

    from agentrl.config import RunConfig
    from agentrl.engine.sglang.launcher import SGLangNotInstalled
    from agentrl.run.launch import start_on_ray

    cfg = RunConfig()
    cfg.cluster.colocate = True
    cfg.cluster.use_sglang_router = True
    cfg.checkpoint.save = str(tmp_path)
    with pytest.raises(
        SGLangNotInstalled, match="sglang_router.*pip install 'agentrl\\[sglang\\]'"
    ):
        await start_on_ray(cfg, str(tmp_path), num_optimizer_steps=1)
    assert not ray.is_initialized()


async def test_placement_flags_without_ray_installed_name_the_extra(tmp_path, monkeypatch):
    import importlib.util
    import sys

    from agentrl.config import ConfigError, RunConfig
    from agentrl.run.launch import start_on_ray

    find_spec = importlib.util.find_spec
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as without the extra
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a)
    )
    cfg = RunConfig()
    cfg.cluster.colocate = True
    cfg.checkpoint.save = str(tmp_path)
    with pytest.raises(ConfigError, match="not installed: pip install 'agentrl\\[ray\\]'"):
        await start_on_ray(cfg, str(tmp_path), num_optimizer_steps=1)
