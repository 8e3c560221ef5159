"""Where the trainer ranks and the engine servers live: a plan from slime's placement flags
(pure, checked before anything starts) and the one Ray placement group that realises it.

Semantics follow THUDM/slime `slime/ray/placement_group.py`: one PACK placement group of
`{"GPU": 1, "CPU": 1}` bundles, sorted by (node IP, GPU id); colocated = the engines sit on the
trainer's bundles (offset 0, fractional requests); disaggregated = trainer bundles first, then the
rollout bundles. On a machine without CUDA each "GPU" is one CPU worker process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrl.config import ClusterConfig, ConfigError
from agentrl.config_checks import rollout_gpus

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

# Fractions of a bundle's GPU (or CPU) each actor asks for: both fit on one bundle when colocated.
TRAINER_SHARE_COLOCATED = 0.4
ENGINE_SHARE_COLOCATED = 0.2


@dataclass(frozen=True)
class BundlePlan:
    """Bundle indices (after sorting) of every trainer rank and every engine server."""

    num_bundles: int
    trainer_bundles: list[int]  # rank r -> bundle
    engine_bundles: list[list[int]]  # engine e -> its bundles (its first one hosts the actor)
    is_colocated: bool
    use_gpu: bool

    @property
    def num_trainer_ranks(self) -> int:
        return len(self.trainer_bundles)

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


def plan_placement(cfg: ClusterConfig, *, use_gpu: bool) -> BundlePlan:
    """The layout the flags describe (`config_checks.check_run` refused contradicting ones)."""
    num_trainer = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
    num_rollout = rollout_gpus(cfg)
    per_engine = cfg.rollout_num_gpus_per_engine
    offset = 0 if cfg.colocate else num_trainer
    num_bundles = num_trainer if cfg.colocate else num_trainer + num_rollout
    engines = [
        list(range(offset + e * per_engine, offset + (e + 1) * per_engine))
        for e in range(num_rollout // per_engine)
    ]
    return BundlePlan(num_bundles, list(range(num_trainer)), engines, cfg.colocate, use_gpu)


def check_capacity(placement: BundlePlan, cfg: ClusterConfig, available: float) -> None:
    """Refuse a layout the Ray cluster cannot hold, before any actor starts."""
    if placement.num_bundles <= available:
        return
    unit = "GPUs" if placement.use_gpu else "CPU worker slots"
    layout = (
        f"--colocate: max(trainer, rollout) = {placement.num_bundles}"
        if placement.is_colocated
        else f"trainer {placement.num_trainer_ranks} + rollout {rollout_gpus(cfg)} = "
        f"{placement.num_bundles}"
    )
    raise ConfigError(
        f"the layout needs {placement.num_bundles} {unit} ({layout}; --actor-num-nodes="
        f"{cfg.actor_num_nodes}, --actor-num-gpus-per-node={cfg.actor_num_gpus_per_node}, "
        f"--rollout-num-gpus={rollout_gpus(cfg)}, --rollout-num-gpus-per-engine="
        f"{cfg.rollout_num_gpus_per_engine}) but the Ray cluster has {available:g}; "
        "ask for fewer or add nodes"
    )


# ---------------------------------------------------------------- Ray


@dataclass
class BundleInfo:
    """Where a bundle landed: its node and its physical device id on that node."""

    index: int  # index in the placement group as created
    node_ip: str
    device_id: int


def create_placement_group(
    placement: BundlePlan, *, timeout_s: float = 120.0
) -> tuple[PlacementGroup, list[BundleInfo]]:
    """One PACK placement group; returns it with its bundles sorted by (node IP, device id), so
    bundle k of the plan is `sorted_bundles[k]`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle: dict[str, float] = {"GPU": 1, "CPU": 1} if placement.use_gpu else {"CPU": 1}
    bundles = [dict(bundle) for _ in range(placement.num_bundles)]
    pg = placement_group(bundles, strategy="PACK")
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        raise ConfigError(
            f"Ray could not reserve {placement.num_bundles} bundles of {bundles[0]} within "
            f"{timeout_s:g}s (cluster resources: {ray.cluster_resources()}); lower the placement "
            "flags or add nodes"
        )
    probe, gpus = ray.remote(_bundle_info), 0.01 if placement.use_gpu else 0
    infos = ray.get([
        probe.options(num_cpus=0.01, num_gpus=gpus, scheduling_strategy=bundle_strategy(pg, i))
        .remote(i, placement.use_gpu)
        for i in range(placement.num_bundles)
    ])  # fmt: skip
    return pg, sorted(infos, key=lambda b: (b.node_ip, b.device_id, b.index))


def _bundle_info(index: int, use_gpu: bool) -> BundleInfo:
    import ray

    ip = ray.util.get_node_ip_address()
    return BundleInfo(index, ip, int(ray.get_gpu_ids()[0]) if use_gpu else index)


def bundle_strategy(pg: Any, bundle_index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        placement_group=pg,
        placement_group_bundle_index=bundle_index,
        placement_group_capture_child_tasks=True,
    )
