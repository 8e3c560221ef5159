"""The run's one Ray placement group: a PACK group of the `Deployment`'s bundles, sorted by (node
IP, device id) so bundle k of the plan is the k-th; where each landed (`BundleInfo`); how an
actor is pinned to its bundle (`bundle_strategy`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrl.config import ConfigError
from agentrl.deploy.plan import Deployment

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup


@dataclass
class BundleInfo:
    """Where a bundle landed: its node and its physical device id on that node."""

    index: int  # index in the placement group as created
    node_ip: str
    device_id: int


def create_placement_group(
    plan: Deployment, *, timeout_s: float = 120.0
) -> tuple[PlacementGroup, list[BundleInfo]]:
    """One PACK placement group; returns it with its bundles sorted by (node IP, device id), so
    bundle k of the plan is `sorted_bundles[k]`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle: dict[str, float] = {"GPU": 1, "CPU": 1} if plan.use_gpu else {"CPU": 1}
    bundles = [dict(bundle) for _ in range(plan.num_bundles)]
    pg = placement_group(bundles, strategy="PACK")
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        raise ConfigError(
            f"Ray could not reserve {plan.num_bundles} bundles of {bundles[0]} within "
            f"{timeout_s:g}s (cluster resources: {ray.cluster_resources()}); lower the placement "
            "flags or add nodes"
        )
    probe = ray.remote(_bundle_info)
    gpus = 0.01 if plan.use_gpu else 0
    infos = ray.get(
        [
            probe.options(
                num_cpus=0.01, num_gpus=gpus, scheduling_strategy=bundle_strategy(pg, i)
            ).remote(i, plan.use_gpu)
            for i in range(plan.num_bundles)
        ]
    )
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
