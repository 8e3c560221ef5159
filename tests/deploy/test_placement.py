"""The run's `Deployment` from slime's flags: bundle layout, colocation, transport, servers, and
refusals that name the flags and the numbers before anything starts."""

from __future__ import annotations

import pytest

from agentrl.config import ClusterConfig, ConfigError, EngineConfig, ModelConfig, RunConfig
from agentrl.config_checks import check_run
from agentrl.deploy.plan import plan_deployment


def test_disaggregated_puts_trainer_bundles_first_then_engines():
    cluster = ClusterConfig(
        actor_num_gpus_per_node=2, rollout_num_gpus=4, rollout_num_gpus_per_engine=2
    )
    plan = plan_deployment(RunConfig(cluster=cluster), has_cuda=True)
    assert plan.is_on_ray and plan.kind == "disaggregated" and not plan.shares_gpu
    assert plan.num_bundles == 6
    assert plan.trainer_bundles == (0, 1)
    assert plan.engine_bundles == ((2, 3), (4, 5))
    assert (plan.num_engines, plan.gpus_per_engine) == (2, 2)
    assert plan.colocated_rank(0) is None
    assert plan.trainer_share == plan.engine_share == 1.0
    assert plan.transport == "distributed" and plan.pauses_servers


def test_colocated_engines_share_the_trainer_bundles():
    cluster = ClusterConfig(actor_num_nodes=2, actor_num_gpus_per_node=2, colocate=True)
    plan = plan_deployment(RunConfig(cluster=cluster), has_cuda=False)
    assert plan.kind == "colocated" and plan.shares_gpu and plan.transport == "tensor"
    assert plan.engine_server == "agentrl"  # no GPU: `agentrl serve`, whatever is installed
    assert plan.num_bundles == 4
    assert plan.engine_bundles == ((0,), (1,), (2,), (3,))  # rollout GPUs default to the trainer's
    assert [plan.colocated_rank(e) for e in range(4)] == [0, 1, 2, 3]
    assert plan.trainer_share + plan.engine_share <= 1.0


def test_in_process_engines_share_the_trainers_gpu_unless_remote():
    """An embedded engine, or servers launched here, take turns with the trainer's GPU memory; a
    remote `engine.kind=http` server does not; nothing is shared on CPU."""
    for kind, shares in (("local", True), ("sglang", True), ("http", False)):
        engine = EngineConfig(kind=kind, url="http://127.0.0.1:1" if kind == "http" else None)
        plan = plan_deployment(RunConfig(engine=engine), has_cuda=True)
        assert (plan.kind, plan.is_on_ray, plan.num_trainer_ranks) == ("in_process", False, 1)
        assert plan.shares_gpu is shares, kind
        assert plan.transport == "tensor" and not plan.pauses_servers
    assert not plan_deployment(RunConfig(), has_cuda=False).shares_gpu


def test_launched_servers_take_their_count_restarts_and_router_from_the_cluster_section():
    """One spelling for the servers launched from this process and on Ray: slime's flags;
    with engine.kind=sglang, --rollout-num-gpus sizes the servers this process launches."""
    cluster = ClusterConfig(
        rollout_num_gpus=4,
        rollout_num_gpus_per_engine=2,
        max_engine_restarts=1,
        use_sglang_router=True,
        router_policy="round_robin",
    )
    plan = plan_deployment(
        RunConfig(engine=EngineConfig(kind="sglang"), cluster=cluster), has_cuda=True
    )
    assert (plan.kind, plan.engine_server) == ("in_process", "sglang")
    assert (plan.num_engines, plan.gpus_per_engine, plan.max_engine_restarts) == (2, 2, 1)
    assert (plan.use_router, plan.router_policy) == (True, "round_robin")
    on_ray = plan_deployment(RunConfig(cluster=cluster), has_cuda=True)
    assert (on_ray.kind, on_ray.num_engines, on_ray.gpus_per_engine) == ("disaggregated", 2, 2)
    assert (on_ray.max_engine_restarts, on_ray.use_router, on_ray.router_policy) == (
        1,
        True,
        "round_robin",
    )
    one = plan_deployment(RunConfig(engine=EngineConfig(kind="sglang")), has_cuda=True)
    assert (one.num_engines, one.gpus_per_engine, one.use_router) == (1, 1, False)
    assert plan_deployment(RunConfig(), has_cuda=False).engine_server == "embedded"


def test_launched_servers_must_fill_their_gpus():
    cfg = RunConfig(
        engine=EngineConfig(kind="sglang"),
        cluster=ClusterConfig(rollout_num_gpus=3, rollout_num_gpus_per_engine=2),
    )
    with pytest.raises(
        ConfigError, match=r"--rollout-num-gpus=3 .*--rollout-num-gpus-per-engine=2"
    ):
        plan_deployment(cfg, has_cuda=True)


def test_async_next_to_an_engine_that_shares_the_gpu_is_refused():
    cfg = RunConfig(model=ModelConfig(device="cpu"))
    cfg.train.use_async = True
    assert plan_deployment(cfg, has_cuda=False).kind == "in_process"  # CPU: nothing shared
    with pytest.raises(ConfigError, match="--async generates while the trainer steps"):
        plan_deployment(cfg, has_cuda=True)
    cfg.cluster.colocate = True
    with pytest.raises(ConfigError, match="--async generates while the trainer steps"):
        plan_deployment(cfg, has_cuda=False)


def test_a_broadcast_to_the_in_process_engine_is_refused():
    cfg = RunConfig(cluster=ClusterConfig(update_weight_transport="distributed"))
    with pytest.raises(ConfigError, match="--update-weight-transport=distributed needs engine"):
        plan_deployment(cfg, has_cuda=False)


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
    cluster = ClusterConfig(actor_num_gpus_per_node=4, rollout_num_gpus=4)
    plan = plan_deployment(RunConfig(cluster=cluster), has_cuda=True)
    with pytest.raises(ConfigError) as err:
        plan.check_capacity(available=2)
    message = str(err.value)
    assert "needs 8 GPUs" in message and "trainer 4 + rollout 4" in message
    assert "= 4" in message and "--rollout-num-gpus=4" in message and "has 2" in message
    plan.check_capacity(available=8)  # fits: no error


async def test_asking_for_sglang_router_without_it_fails_before_anything_starts(tmp_path):
    import ray

    from agentrl.config import RunConfig
    from agentrl.deploy.launch import start_on_ray
    from agentrl.deploy.processes import SGLangNotInstalled

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
    from agentrl.deploy.launch import start_on_ray

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
