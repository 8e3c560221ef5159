"""`Deployment`: where a run's trainer and engines live, computed once from the config and asked
everywhere after (as torchtitan's `ParallelDims` is): Ray or this process, colocated or
disaggregated, trainer ranks, engine servers (how many, GPUs each, which server), whether they
share the trainer's GPUs, how weights travel, restarts, router, offload, and the Ray bundle
layout. Pure: it imports nothing heavy and starts nothing; `plan_deployment` refuses a layout
that contradicts itself in one `ConfigError` naming the flags.

Bundle semantics follow THUDM/slime `slime/ray/placement_group.py`: one PACK placement group of
`{"GPU": 1, "CPU": 1}` bundles, sorted by (node IP, GPU id); colocated = the engines sit on the
trainer's bundles (offset 0, fractional requests); disaggregated = trainer bundles first, then
the rollout bundles. On a machine without CUDA each "GPU" is one CPU worker process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from agentrl.config import ConfigError, RunConfig

PlacementKind = Literal["in_process", "colocated", "disaggregated"]
Transport = Literal["tensor", "distributed", "disk"]
EngineServer = Literal["embedded", "remote", "sglang", "agentrl"]
"""embedded: a `LocalEngine` in this process; remote: a server at `engine.url` agentrl does not
run; sglang: SGLang servers agentrl launches and supervises; agentrl: `agentrl serve` servers
agentrl launches on Ray (where SGLang is missing or there is no GPU)."""

# Fractions of a bundle's GPU (or CPU) each actor asks for: both fit on one bundle when colocated.
TRAINER_SHARE_COLOCATED = 0.4
ENGINE_SHARE_COLOCATED = 0.2


@dataclass(frozen=True)
class Deployment:
    """Every placement fact of a run. `use_gpu`: the trainer runs on CUDA (on Ray: the cluster
    has GPUs, each bundle one of them)."""

    kind: PlacementKind
    is_on_ray: bool
    use_gpu: bool
    num_trainer_ranks: int
    engine_server: EngineServer
    num_engines: int
    gpus_per_engine: int
    shares_gpu: bool  # the engines give their memory to the trainer while it steps
    transport: Transport
    offload_train: bool  # the trainer's optimizer state waits in host memory between steps
    max_engine_restarts: int
    use_router: bool
    router_policy: str
    trainer_bundles: tuple[int, ...] = ()  # Ray: rank r -> bundle (after sorting)
    engine_bundles: tuple[tuple[int, ...], ...] = ()  # Ray: engine e -> its bundles

    @property
    def is_colocated(self) -> bool:
        return self.kind == "colocated"

    @property
    def pauses_servers(self) -> bool:
        """Disaggregated servers may hold requests of others: they pause too (retract)."""
        return self.kind == "disaggregated"

    @property
    def num_bundles(self) -> int:
        return len(set(self.trainer_bundles).union(*self.engine_bundles))

    @property
    def trainer_share(self) -> float:
        return TRAINER_SHARE_COLOCATED if self.is_colocated else 1.0

    @property
    def engine_share(self) -> float:
        return ENGINE_SHARE_COLOCATED if self.is_colocated else 1.0

    def colocated_rank(self, engine_index: int) -> int | None:
        """The trainer rank that shares the engine's first bundle (None when disaggregated)."""
        if not self.is_colocated:
            return None
        first = self.engine_bundles[engine_index][0]
        return self.trainer_bundles.index(first) if first in self.trainer_bundles else None

    def check_capacity(self, available: float) -> None:
        """Refuse a Ray layout the cluster cannot hold, before any actor starts."""
        if self.num_bundles <= available:
            return
        unit = "GPUs" if self.use_gpu else "CPU worker slots"
        num_rollout = self.num_engines * self.gpus_per_engine
        layout = (
            f"--colocate: max(trainer, rollout) = {self.num_bundles}"
            if self.is_colocated
            else f"trainer {self.num_trainer_ranks} + rollout {num_rollout} = {self.num_bundles}"
        )
        raise ConfigError(
            f"the layout needs {self.num_bundles} {unit} ({layout}; --actor-num-gpus-per-node x "
            f"--actor-num-nodes = {self.num_trainer_ranks}, --rollout-num-gpus={num_rollout}, "
            f"--rollout-num-gpus-per-engine={self.gpus_per_engine}) but the Ray cluster has "
            f"{available:g}; ask for fewer or add nodes"
        )


def plan_deployment(cfg: RunConfig, *, has_cuda: bool | None = None) -> Deployment:
    """The run's `Deployment`. `has_cuda`: whether the trainer's device is a GPU (on Ray: whether
    the cluster has GPUs); None = ask torch about `model.device` (auto: a GPU is visible)."""
    if has_cuda is None:
        has_cuda = _device_is_cuda(cfg.model.device)
    if is_on_ray(cfg):
        plan = _ray_plan(cfg, use_gpu=has_cuda)
    else:
        plan = in_process_plan(cfg, use_gpu=has_cuda)
    _check(cfg, plan)
    return plan


def is_on_ray(cfg: RunConfig) -> bool:
    """Whether the run places trainer and engines on Ray (`cluster.use_ray`, else the flags;
    --rollout-num-gpus sizes the servers engine.kind=sglang launches from this process)."""
    c = cfg.cluster
    if c.use_ray is not None:
        return c.use_ray
    return bool(
        c.ray_address
        or os.environ.get("RAY_ADDRESS")
        or c.colocate
        or (c.rollout_num_gpus is not None and cfg.engine.kind != "sglang")
        or c.actor_num_nodes * c.actor_num_gpus_per_node > 1
    )


def in_process_plan(cfg: RunConfig, *, use_gpu: bool) -> Deployment:
    """One trainer rank in this process, and one engine object or the SGLang servers it launches
    (sized, restarted and routed by the cluster section, as on Ray). An embedded engine, or
    launched servers, share the trainer's GPU and take turns with its memory; a remote
    `engine.kind=http` server does not."""
    c = cfg.cluster
    servers: dict[str, EngineServer] = {"local": "embedded", "http": "remote", "sglang": "sglang"}
    server = servers[cfg.engine.kind]
    is_launched = server == "sglang"
    num_gpus = c.rollout_num_gpus or c.rollout_num_gpus_per_engine
    num_engines = _num_engines(cfg, num_gpus) if is_launched else 1
    return Deployment(
        kind="in_process",
        is_on_ray=False,
        use_gpu=use_gpu,
        num_trainer_ranks=1,
        engine_server=server,
        num_engines=num_engines,
        gpus_per_engine=c.rollout_num_gpus_per_engine if is_launched else 1,
        shares_gpu=use_gpu and server != "remote",
        transport=_transport(cfg, "in_process"),
        offload_train=c.offload_train,
        max_engine_restarts=c.max_engine_restarts if is_launched else 0,
        use_router=is_launched and c.use_sglang_router,
        router_policy=c.router_policy,
    )


def _ray_plan(cfg: RunConfig, *, use_gpu: bool) -> Deployment:
    c = cfg.cluster
    num_trainer = c.actor_num_nodes * c.actor_num_gpus_per_node
    num_rollout = c.rollout_num_gpus
    if num_rollout is None:
        num_rollout = num_trainer if c.colocate else 1
    per_engine = c.rollout_num_gpus_per_engine
    num_engines = _num_engines(cfg, num_rollout)
    if c.colocate and num_rollout > num_trainer:
        raise ConfigError(
            f"--colocate puts the engines on the trainer's GPUs, but --rollout-num-gpus={num_rollout} "
            f"> --actor-num-nodes x --actor-num-gpus-per-node = {num_trainer}; lower "
            "--rollout-num-gpus or drop --colocate"
        )
    offset = 0 if c.colocate else num_trainer
    engine_bundles = tuple(
        tuple(range(offset + e * per_engine, offset + (e + 1) * per_engine))
        for e in range(num_engines)
    )
    kind: PlacementKind = "colocated" if c.colocate else "disaggregated"
    return Deployment(
        kind=kind,
        is_on_ray=True,
        use_gpu=use_gpu,
        num_trainer_ranks=num_trainer,
        engine_server=_ray_server(cfg, use_gpu=use_gpu),
        num_engines=len(engine_bundles),
        gpus_per_engine=per_engine,
        shares_gpu=c.colocate,
        transport=_transport(cfg, kind),
        offload_train=c.offload_train,
        max_engine_restarts=c.max_engine_restarts,
        use_router=c.use_sglang_router,
        router_policy=c.router_policy,
        trainer_bundles=tuple(range(num_trainer)),
        engine_bundles=engine_bundles,
    )


def _num_engines(cfg: RunConfig, num_gpus: int) -> int:
    per_engine = cfg.cluster.rollout_num_gpus_per_engine
    if num_gpus % per_engine:
        raise ConfigError(
            f"--rollout-num-gpus={num_gpus} is not a multiple of --rollout-num-gpus-per-engine="
            f"{per_engine}: every engine needs exactly that many GPUs"
        )
    return num_gpus // per_engine


def _ray_server(cfg: RunConfig, *, use_gpu: bool) -> EngineServer:
    """SGLang when asked, or (auto) when it is installed and there are GPUs; else `agentrl serve`."""
    import importlib.util

    choice = cfg.cluster.engine_server
    if choice == "auto":
        has_sglang = use_gpu and importlib.util.find_spec("sglang") is not None
        return "sglang" if has_sglang else "agentrl"
    return choice


def _transport(cfg: RunConfig, kind: PlacementKind) -> Transport:
    """`cluster.update_weight_transport`; auto: tensors where trainer and engines share a
    process or a host's GPUs, a broadcast when disaggregated."""
    transport = cfg.cluster.update_weight_transport
    if transport == "auto":
        return "distributed" if kind == "disaggregated" else "tensor"
    return transport


def _check(cfg: RunConfig, plan: Deployment) -> None:
    """Settings this layout cannot honour, in one line naming the flags and the fix."""
    if plan.engine_server == "embedded" and plan.transport != "tensor":
        raise ConfigError(
            f"--update-weight-transport={plan.transport} needs engine servers (Ray placement "
            "flags, or engine.kind=http/sglang); the in-process engine takes tensors: use auto "
            "or tensor"
        )
    if cfg.train.use_async and (plan.is_colocated or (plan.shares_gpu and not plan.is_on_ray)):
        raise ConfigError(
            "--async generates while the trainer steps, but colocated engines give their memory "
            "to the trainer then: run disaggregated (e.g. --actor-num-gpus-per-node 1 "
            "--rollout-num-gpus 1, without --colocate), or in one process on CPU"
        )


def _device_is_cuda(device: str) -> bool:
    """Whether a trainer on `model.device` runs on CUDA here (auto: when a GPU is visible)."""
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch

    return torch.cuda.is_available()
