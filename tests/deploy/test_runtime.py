"""Pure parts of the `Runtime`: which batch each trainer rank trains on."""

from __future__ import annotations

import pytest

from agentrl.deploy.runtime import batches_per_rank


def test_fsdp_ranks_take_one_batch_each():
    assert batches_per_rank(["b0", "b1", "b2"], [0, 1, 2]) == ["b0", "b1", "b2"]


def test_megatron_tp_and_pp_ranks_of_a_replica_share_its_batch():
    # 8 ranks, TP=2, PP=2, DP=2 in Megatron's order (TP fastest, then DP, then PP)
    dp_ranks = [0, 0, 1, 1, 0, 0, 1, 1]
    assert batches_per_rank(["a", "b"], dp_ranks) == ["a", "a", "b", "b", "a", "a", "b", "b"]


def test_a_batch_count_that_is_not_the_dp_size_is_refused():
    with pytest.raises(ValueError, match=r"3 batches for data-parallel ranks \[0, 1\]"):
        batches_per_rank(["a", "b", "c"], [0, 0, 1, 1])


def test_agentrl_serve_gets_the_kv_fraction_and_the_trainers_reserve():
    """engine.mem_fraction_static reaches the `agentrl serve` it launches (it was dropped), and
    a colocated engine leaves its rank's optimizer state out of the KV cache. (The Ray tests of
    tests/deploy/test_ray_train.py launch `agentrl serve` with these flags.)"""
    from agentrl.config import ClusterConfig, EngineConfig, RunConfig
    from agentrl.deploy.plan import plan_deployment
    from agentrl.deploy.servers import ServerSpec, reserve_for, server_cmd

    spec = ServerSpec(index=0, model_path="m", device_ids=[1], use_gpu=True, use_sglang=False,
                      host="127.0.0.1", dtype="bfloat16", engine=EngineConfig(mem_fraction_static=0.65),
                      log_dir=".", health_timeout_s=1, reserve_bytes=3 * 2**30)  # fmt: skip
    cmd = server_cmd(spec, port=1234)
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.65"
    assert cmd[cmd.index("--reserve-gb") + 1] == "3.000"
    assert cmd[cmd.index("--device") + 1] == "cuda:1"
    colocated = plan_deployment(
        RunConfig(cluster=ClusterConfig(actor_num_gpus_per_node=2, colocate=True)), has_cuda=True
    )
    assert [reserve_for(colocated, e, [10, 20]) for e in (0, 1)] == [10, 20]
    apart = plan_deployment(RunConfig(cluster=ClusterConfig(rollout_num_gpus=1)), has_cuda=True)
    assert reserve_for(apart, 0, [10]) == 0


class _Engines:
    """An `EngineGroup` that records what the runtime asks of it, in order."""

    def __init__(self, calls: list) -> None:
        from agentrl.engine.gate import GatedEngine

        self.calls, self.version = calls, "0"
        self.engine = GatedEngine(object())  # type: ignore[arg-type]

    weight_version = property(lambda self: self.version)

    def set_weight_version(self, version):
        self.calls.append(("version", version))
        self.version = version

    async def pause_generation(self, mode):
        self.calls.append(("pause", mode))

    async def continue_generation(self):
        self.calls.append(("continue",))

    async def release_memory(self):
        self.calls.append(("release",))

    async def resume_memory(self, tags):
        self.calls.append(("resume", *tags))

    async def memory_bytes(self):
        return None

    def servers(self):
        return []

    def weight_targets(self, num_ranks, transport):
        return [[f"engine-of-rank-{r}"] for r in range(num_ranks)]

    async def heal(self):
        return []

    def servers_down(self):
        return []

    def mark_all_up(self):
        pass


class _Worker:
    def __init__(self, rank: int, calls: list) -> None:
        self.rank, self.calls = rank, calls

    def pad_id(self):
        return 0

    def data_parallel_rank(self):
        return self.rank

    def connect_engines(self, targets, transport):
        self.calls.append(("connect", self.rank, *targets, transport))

    def train_step(self, batch):
        self.calls.append(("train", self.rank, batch))
        return {"loss": 1.0}

    def send_weights(self, version):
        self.calls.append(("send", self.rank, version))
        return {"bytes": 8.0, "export_s": 0.0, "send_s": 0.0}


async def _choreography(kind: str, shares_gpu: bool) -> list:
    from agentrl.config import ClusterConfig, RunConfig
    from agentrl.deploy.plan import plan_deployment
    from agentrl.deploy.runtime import Runtime
    from agentrl.deploy.trainer_worker import TrainerGroup

    calls: list = []
    trainer = TrainerGroup([_Worker(0, calls), _Worker(1, calls)], is_remote=False)
    cluster = ClusterConfig(
        actor_num_gpus_per_node=2,
        colocate=kind == "colocated",
        update_weight_transport="tensor",
    )
    plan = plan_deployment(RunConfig(cluster=cluster), has_cuda=True)
    assert (plan.kind, plan.shares_gpu) == (kind, shares_gpu)
    runtime = Runtime(plan, trainer, _Engines(calls), temperature=1.0, check_weight_sync=True)
    await runtime.start()
    metrics = await runtime.train_step(["batch-0", "batch-1"])
    assert metrics["loss"] == 1.0
    sync = await runtime.sync_weights(1)
    assert sync["weight_sync/bytes"] == 8.0
    return sorted(calls[:2]) + [c for c in calls[2:]]


async def test_colocated_engines_give_memory_for_the_step_and_take_it_back_around_the_sync():
    calls = await _choreography("colocated", shares_gpu=True)
    assert calls[:2] == [("connect", 0, "engine-of-rank-0", "tensor"),
                         ("connect", 1, "engine-of-rank-1", "tensor")]  # fmt: skip
    assert calls[2] == ("release",)
    assert sorted(calls[3:5]) == [("train", 0, "batch-0"), ("train", 1, "batch-1")]
    assert calls[5] == ("resume", "weights")
    assert sorted(calls[6:8]) == [("send", 0, 1), ("send", 1, 1)]
    assert calls[8:] == [("version", 1), ("resume", "kv_cache", "cuda_graph")]


async def test_disaggregated_servers_pause_for_the_sync_and_keep_their_memory():
    calls = await _choreography("disaggregated", shares_gpu=False)
    assert ("release",) not in calls and not [c for c in calls if c[0] == "resume"]
    assert calls[4] == ("pause", "retract")
    assert sorted(calls[5:7]) == [("send", 0, 1), ("send", 1, 1)]
    assert calls[7:] == [("continue",), ("version", 1)]


async def test_a_lora_sync_names_its_adapter_on_the_served_clients() -> None:
    """On Ray the trainer's sender has clients of its own: after an adapter-only sync the runtime
    names the version's adapter on the routed clients the rollouts generate with."""
    from types import SimpleNamespace

    from agentrl.config import ClusterConfig, RunConfig
    from agentrl.deploy.plan import plan_deployment
    from agentrl.deploy.runtime import Runtime
    from agentrl.deploy.trainer_worker import TrainerGroup

    class LoraWorker(_Worker):
        def send_weights(self, version):
            return {"bytes": 8.0, "adapter_bytes": 8.0, "export_s": 0.0, "send_s": 0.0}

    clients = [SimpleNamespace(lora_name=None), SimpleNamespace(lora_name=None)]
    engines = _Engines([])
    engines.servers = lambda: clients  # type: ignore[method-assign]
    cluster = ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=2)
    plan = plan_deployment(RunConfig(cluster=cluster), has_cuda=True)
    trainer = TrainerGroup([LoraWorker(0, [])], is_remote=False)
    runtime = Runtime(plan, trainer, engines, temperature=1.0, check_weight_sync=False)
    sync = await runtime.sync_weights(3)
    assert sync["weight_sync/bytes"] == sync["weight_sync/adapter_bytes"] == 8.0
    assert [c.lora_name for c in clients] == ["agentrl-v3", "agentrl-v3"]


def test_a_lora_runs_servers_keep_their_base_and_take_adapters():
    """Under LoRA the trainer sends the adapter alone: a colocated server keeps a host copy of
    its base through a release, and SGLang starts with LoRA on (rank, every linear target)."""
    from agentrl.config import EngineConfig
    from agentrl.deploy.servers import ServerSpec, server_cmd

    def spec(**kw) -> ServerSpec:
        fields = dict(index=0, model_path="m", device_ids=[0], use_gpu=True, host="127.0.0.1")
        fields |= dict(dtype="bfloat16", engine=EngineConfig(), log_dir=".", health_timeout_s=1)
        return ServerSpec(**fields, is_colocated=True, **kw)

    assert "--no-weights-cpu-backup" in server_cmd(spec(use_sglang=False), port=1)
    assert "--weights-cpu-backup" in server_cmd(spec(use_sglang=False, lora_rank=16), port=1)
    sglang = server_cmd(spec(use_sglang=True, lora_rank=16), port=1)
    assert sglang[sglang.index("--max-lora-rank") + 1] == "16" and "--enable-lora" in sglang
    assert "--enable-weights-cpu-backup" in sglang and "--lora-target-modules" in sglang
    assert "--enable-lora" not in server_cmd(spec(use_sglang=True), port=1)
