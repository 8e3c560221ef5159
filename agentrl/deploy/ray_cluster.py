"""A run's share of Ray (`RayCluster`): a local Ray started for the run (loopback only, reaped)
or a cluster joined, one placement group realising the `Deployment`'s bundles, and the
trainer-rank and engine-server actors on it. `agentrl.deploy.launch` assembles them into the
run's `Runtime`. The only module with `agentrl.deploy.servers` that imports `ray`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentrl.config import ConfigError, RunConfig
from agentrl.deploy import reaper
from agentrl.deploy.engines import ServedEngineGroup
from agentrl.deploy.placement_group import (
    BundleInfo,
    bundle_strategy,
    create_placement_group,
)
from agentrl.deploy.plan import Deployment, plan_deployment
from agentrl.deploy.processes import choose_router, free_ports, require_module
from agentrl.deploy.servers import RayServer, engine_api_key, engine_hosts, start_engine_actors
from agentrl.deploy.supervisor import RouterOptions, ServerSupervisor

log = logging.getLogger(__name__)

# Ray must not pick CUDA_VISIBLE_DEVICES for fractional actors: each picks its bundle's GPU itself.
_WORKER_ENV = {
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def init_ray(address: str | None, num_bundles: int) -> bool:
    """Join `address` (`cluster.ray_address`, else RAY_ADDRESS), else start a local Ray for this
    run (on 127.0.0.1 only, and reaped if this process dies without `ray.shutdown()`). Returns
    whether this call connected (so `ray.shutdown()` at the end: it stops a Ray started here and
    only disconnects from a cluster that was joined)."""
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": _WORKER_ENV}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return True
    before = reaper.children(os.getpid())
    with _loopback_node_ip():
        # Logical CPUs: a CPU-only layout runs one worker per "GPU" even on a 2-core machine.
        ray.init(
            address="local",  # not None: that joins the cluster of the last `ray start`
            num_cpus=max(os.cpu_count() or 1, num_bundles + 1),
            include_dashboard=False,
            runtime_env=runtime_env,
            log_to_driver=True,
            configure_logging=False,
            _node_ip_address="127.0.0.1",
        )
    # A SIGKILLed driver takes gcs_server and raylet along (Ray's fate-sharing) but not
    # raylet's agents and workers: the reaper ends them.
    if not reaper.start(reaper.children(os.getpid()) - before):
        log.warning("no reaper for this Ray (no /proc?): a SIGKILLed driver leaves its agents")
    return True


@contextlib.contextmanager
def _loopback_node_ip() -> Iterator[None]:
    """A local Ray on 127.0.0.1: its gRPC servers bind to loopback when the node IP is
    loopback, but `ray.init` replaces a loopback `_node_ip_address` by the machine's address
    (`services.resolve_ip_for_localhost`) unless clusters are off, the switch Ray keeps for
    macOS and Windows (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, read once at import)."""
    from ray._private import ray_constants

    saved = getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:  # the node keeps its address; later calls (joining a cluster) see Ray's own value
        ray_constants.ENABLE_RAY_CLUSTER = saved


class RayCluster:
    """This run's share of Ray: the placement group from the flags and the actors on it.
    `RayCluster.start(cfg)`, then `start_ranks` and `start_engines` (trainer ranks, then servers);
    `release()` ends them all, and Ray itself when this run started it."""

    def __init__(
        self, cfg: RunConfig, owns_ray: bool, plan: Deployment, pg: Any, bundles: list[BundleInfo]
    ) -> None:
        self.cfg = cfg
        self.owns_ray = owns_ray
        self.plan = plan
        self.pg = pg
        self.bundles = bundles
        self.actors: list[Any] = []

    @classmethod
    def start(cls, cfg: RunConfig) -> RayCluster:
        _require_asked_packages(cfg)  # before anything starts (or is imported)
        import ray
        import torch

        address = cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS")
        guess = plan_deployment(cfg, has_cuda=torch.cuda.is_available() and not address)
        owns_ray = init_ray(address, guess.num_bundles)
        try:
            # the plan of record: whether each bundle is a GPU is the cluster's answer
            plan = plan_deployment(cfg, has_cuda=ray.cluster_resources().get("GPU", 0) > 0)
            unit = "GPU" if plan.use_gpu else "CPU"
            plan.check_capacity(ray.available_resources().get(unit, 0) - (0 if plan.use_gpu else 1))
            pg, bundles = create_placement_group(plan)
        except BaseException:
            if owns_ray:
                ray.shutdown()
            raise
        return cls(cfg, owns_ray, plan, pg, bundles)

    async def rank_slots(self) -> list[dict[str, Any]]:
        """Where each trainer rank runs: its rank, device, process group address and port."""
        import ray

        plan = self.plan
        bundles = self.bundles
        first = bundles[plan.trainer_bundles[0]]
        master_port = (
            await ray.remote(_free_port)
            .options(num_cpus=0.01, scheduling_strategy=bundle_strategy(self.pg, first.index))
            .remote()
        )
        return [
            dict(
                rank=rank,
                world_size=plan.num_trainer_ranks,
                master_addr=first.node_ip,
                master_port=master_port,
                device_id=bundles[b].device_id,
                device=f"cuda:{bundles[b].device_id}" if plan.use_gpu else "cpu",
            )
            for rank, b in enumerate(plan.trainer_bundles)
        ]

    async def start_ranks(self, worker_cls: type, specs: list[Any]) -> list[Any]:
        """One `worker_cls(spec)` actor per trainer rank, on its bundle; waits for their models."""
        import ray

        plan = self.plan
        actor_cls = ray.remote(worker_cls)
        ranks = [
            actor_cls.options(
                num_cpus=plan.trainer_share if not plan.use_gpu else 0.1,
                num_gpus=plan.trainer_share if plan.use_gpu else 0,
                scheduling_strategy=bundle_strategy(self.pg, self.bundles[b].index),
            ).remote(spec)
            for b, spec in zip(plan.trainer_bundles, specs, strict=True)
        ]
        self.actors.extend(ranks)
        await asyncio.gather(*(r.pad_id.remote() for r in ranks))  # every rank built its model
        return ranks

    @functools.cached_property
    def engine_api_key(self) -> str | None:
        """The engine servers' key, decided once (`engine_api_key`): the trainer ranks' specs
        and the servers take it from here."""
        return engine_api_key(self.cfg, engine_hosts(self.plan, self.bundles))

    async def start_engines(self, model_path: str, reserves: list[int]) -> ServedEngineGroup:
        """The engine servers, healthy, and their group; `reserves[rank]`: what a colocated
        engine leaves for the trainer rank on its GPU."""
        cfg = self.cfg
        plan = self.plan
        api_key = self.engine_api_key
        actors = start_engine_actors(
            cfg, plan, self.pg, self.bundles, model_path, reserves, api_key
        )
        self.actors.extend(actors)
        log_path = Path(cfg.checkpoint.save) / "engine_logs" / "router.log"
        supervisor = ServerSupervisor(
            [RayServer(a) for a in actors],
            max_restarts=plan.max_engine_restarts,
            router=RouterOptions(log_path, plan.router_policy) if plan.use_router else None,
            api_key=api_key,
        )
        # the clients' copy of the engine section carries the key; the run's config does not
        engine_cfg = dataclasses.replace(cfg.engine, api_key=api_key)
        return await ServedEngineGroup.start(supervisor, engine_cfg, cfg.rollout, plan)

    def release(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        with contextlib.suppress(Exception):
            remove_placement_group(self.pg)
        if self.owns_ray:
            ray.shutdown()


def _require_asked_packages(cfg: RunConfig) -> None:
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(
            "the placement flags run trainer and engines on Ray, which is not installed: "
            "pip install 'agentrl[ray]'"
        )
    if cfg.cluster.engine_server == "sglang":
        require_module("sglang")
    if cfg.cluster.use_sglang_router:
        choose_router()  # smg, else sglang_router


def _free_port() -> int:
    return free_ports(1, "0.0.0.0")[0]
