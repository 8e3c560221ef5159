"""The engine group: one inference server per `rollout_num_gpus_per_engine` GPUs, each launched
from a Ray actor on its bundle -- real SGLang when installed, else `agentrl serve` (the same HTTP
API) -- health-waited at start, restarted when it dies, and reached through one `RoutedEngine`."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.util
import logging
import os
import secrets
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.cluster.placement import BundleInfo, BundlePlan, bundle_strategy
from agentrl.config import EngineConfig, RunConfig
from agentrl.engine.factory import sglang_client
from agentrl.engine.gate import GatedEngine
from agentrl.engine.router import RoutedEngine
from agentrl.engine.sglang import SGLangEngine
from agentrl.engine.sglang.launcher import (
    ManagedProcess,
    free_ports,
    server_command,
    start_router,
    wait_healthy,
)
from agentrl.engine.sglang.protocol import API_KEY_ENV, resolve_api_key
from agentrl.engine.sglang.supervisor import heal_servers

log = logging.getLogger(__name__)


@dataclass
class ServerSpec:
    """What one engine actor launches: the command line follows from it."""

    index: int
    model_path: str
    device_ids: list[int]
    use_gpu: bool
    use_sglang: bool
    host: str
    dtype: str
    engine: EngineConfig  # the KV fraction, agentrl serve's batch size, SGLang's own flags
    log_dir: str
    health_timeout_s: float
    reserve_bytes: int = 0  # colocated: the trainer's state to come, left out of the KV cache
    is_colocated: bool = False  # shares its GPUs with trainer ranks: releases memory per step
    api_key: str | None = None  # the server wants `Authorization: Bearer <key>`


def server_cmd(spec: ServerSpec, port: int) -> list[str]:
    if spec.use_sglang:
        return server_command(
            spec.model_path,
            spec.engine,
            host=spec.host,
            port=port,
            tp_size=len(spec.device_ids),
            base_gpu_id=spec.device_ids[0] if spec.use_gpu else 0,
            enable_memory_saver=spec.is_colocated,
            api_key=spec.api_key,
        )
    device = f"cuda:{spec.device_ids[0]}" if spec.use_gpu else "cpu"
    return [sys.executable, "-m", "agentrl.cli", "serve", "--model", spec.model_path,
            "--host", spec.host, "--port", str(port), "--device", device,
            "--dtype", spec.dtype, "--max-batch-size", str(spec.engine.max_batch_size),
            "--mem-fraction-static", str(spec.engine.mem_fraction_static),
            "--reserve-gb", f"{spec.reserve_bytes / 2**30:.3f}",
            "--log-level", "warning",
            # Colocated: the trainer resends every weight after a release, no host copy needed.
            "--no-weights-cpu-backup" if spec.is_colocated else "--weights-cpu-backup",
            ]  # fmt: skip


def server_env(spec: ServerSpec) -> dict[str, str]:
    # GPUs: every process sees every GPU of the node and picks its own by id (--device cuda:N,
    # SGLang's --base-gpu-id), as slime does: NCCL between processes that see different device
    # sets cannot use peer-to-peer copies.
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    # The server imports the agentrl this actor runs, installed or a checkout.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    if not spec.use_gpu:  # one CPU "GPU" per worker: threads beyond that only fight each other
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    # `agentrl serve` reads its --api-key from here (off the command line, out of `ps`)
    env.pop(API_KEY_ENV, None)
    if spec.api_key:
        env[API_KEY_ENV] = spec.api_key
    return env


class EngineServer(ManagedProcess):
    """Ray actor body: one server process on its bundle's node, on a fresh port at each start."""

    def __init__(self, spec: ServerSpec) -> None:
        log_path = Path(spec.log_dir) / f"engine-{spec.index}.log"
        super().__init__(
            f"engine-{spec.index}", "", [], log_path, server_env(spec), die_with_parent=True
        )
        self.spec = spec

    def start(self) -> str:
        """Launch (or relaunch on a fresh port) and wait for `/health_generate`; returns the URL."""
        self.stop()
        (port,) = free_ports(1, self.spec.host)
        self.url, self.cmd = f"http://{self.spec.host}:{port}", server_cmd(self.spec, port)
        super().start()
        wait_healthy(self, timeout_s=self.spec.health_timeout_s)
        return self.url

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


class ServedEngineGroup(RoutedEngine):
    """The run's `EngineGroup` on Ray: a `RoutedEngine` over the servers of the actors (the
    weight version they serve included), behind the weight-update gate for rollouts (`engine`)."""

    def __init__(
        self,
        actors: list[Any],
        urls: list[str],
        cfg: RunConfig,
        plan: BundlePlan,
        *,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the key the servers want (`engine_api_key`), else the config's."""
        self.actors, self.urls, self.cfg, self.plan = actors, urls, cfg, plan
        self.api_key = api_key or resolve_api_key(cfg.engine)
        # the clients' copy of the engine section carries the key; the run's config does not
        self.engine_cfg = dataclasses.replace(cfg.engine, api_key=self.api_key)
        self.num_restarts = [0] * len(actors)
        self.router_process: ManagedProcess | None = None
        if cfg.cluster.use_sglang_router:
            logs = Path(cfg.checkpoint.save) / "engine_logs"
            self.router_process = start_router(
                urls, log_path=logs / "router.log", api_key=self.api_key, die_with_parent=True
            )
        client = functools.partial(sglang_client, self.engine_cfg, cfg.rollout)
        router = client(self.router_process.url) if self.router_process else None
        super().__init__([client(u) for u in urls], router=router)
        self.engine = GatedEngine(self)

    @classmethod
    async def start(
        cls, actors: list[Any], cfg: RunConfig, plan: BundlePlan, *, api_key: str | None = None
    ) -> ServedEngineGroup:
        urls = await asyncio.gather(*(a.start.remote() for a in actors))
        group = cls(actors, list(urls), cfg, plan, api_key=api_key)
        versions = {await c.get_weight_version() for c in group.clients}
        if len(versions) != 1:
            raise RuntimeError(f"engine servers started with different weight versions {versions}")
        group.set_weight_version(versions.pop())
        log.info("engine group ready: %s", group.urls)
        return group

    async def memory_bytes(self) -> float | None:
        """Accelerator memory engine 0 holds, as its server reports it (SGLang: the sizes of the
        parts it has not released)."""
        from agentrl.engine.sglang.protocol import memory_bytes_from_server_info

        info = await self.clients[0].get_server_info()
        return memory_bytes_from_server_info(info, self.clients[0].released_tags())

    def servers(self) -> list[SGLangEngine]:
        return list(self.clients)

    def weight_targets(self, num_ranks: int, transport: str) -> list[list[Any]]:
        """Tensors stay on their host: each colocated rank sends to the engines on its GPUs.
        Otherwise rank 0 reaches every engine (a broadcast group, or a directory on disk)."""
        per_rank: list[list[Any]] = [[] for _ in range(num_ranks)]
        if transport == "tensor" and self.plan.is_colocated:
            for e, url in enumerate(self.urls):
                rank = self.plan.colocated_rank(e)
                per_rank[rank if rank is not None else 0].append(url)
        else:
            per_rank[0] = list(self.urls)
        return per_rank

    async def heal(self) -> list[int]:
        """Restart every server that died (`heal_servers`, up to `cluster.max_engine_restarts`
        each, on a fresh port); returns the indices restarted."""
        alive = await asyncio.gather(*(a.is_alive.remote() for a in self.actors))
        dead = await heal_servers(
            list(alive),
            self.urls,
            self.num_restarts,
            restart=lambda i: self.actors[i].start.remote(),
            report=lambda i: self.actors[i].report.remote(),
            max_restarts=self.cfg.cluster.max_engine_restarts,
            router_url=self.router_process.url if self.router_process else None,
            api_key=self.api_key,
        )
        for i in dead:
            await self.clients[i].close()
            self.clients[i] = sglang_client(self.engine_cfg, self.cfg.rollout, self.urls[i])
        return dead

    async def close(self) -> None:
        await super().close()
        if self.router_process is not None:
            self.router_process.stop()
        await asyncio.gather(*(a.stop.remote() for a in self.actors), return_exceptions=True)


def start_engine_actors(
    cfg: RunConfig,
    placement: BundlePlan,
    pg: Any,
    bundles: list[BundleInfo],
    model_path: str,
    reserves: list[int],
    api_key: str | None,
) -> list[Any]:
    """One engine actor per engine, each wanting `api_key` (`engine_api_key`); a colocated one
    leaves `reserves[rank]` bytes for the trainer rank on its GPU."""
    import ray

    # engine_server=sglang: RayCluster.start found the package before anything started
    use_sglang = cfg.cluster.engine_server == "sglang" or (
        cfg.cluster.engine_server == "auto"
        and placement.use_gpu
        and importlib.util.find_spec("sglang") is not None
    )
    log_dir = Path(cfg.checkpoint.save) / "engine_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    actor_cls = ray.remote(EngineServer)
    actors = []
    hosts = engine_hosts(placement, bundles)
    for e, members in enumerate(placement.engine_bundles):
        first, host = bundles[members[0]], hosts[e]
        is_local = host == "127.0.0.1"
        spec = ServerSpec(
            index=e,
            model_path=model_path,
            device_ids=[bundles[b].device_id for b in members],
            use_gpu=placement.use_gpu,
            use_sglang=use_sglang,
            host=host,
            dtype=cfg.model.dtype,
            engine=cfg.engine,
            log_dir=str(log_dir if is_local else tempfile.gettempdir()),
            health_timeout_s=cfg.cluster.engine_start_timeout_s,
            reserve_bytes=reserve_for(placement, e, reserves),
            is_colocated=placement.is_colocated,
            api_key=api_key,
        )
        if use_sglang and spec.reserve_bytes:
            log.warning(
                "engine %d: SGLang sizes its KV cache from --mem-fraction-static alone; the trainer "
                "rank on its GPU will hold %.1f GiB more after its first step (lower "
                "engine.mem_fraction_static if the KV cache cannot resume)",
                e, spec.reserve_bytes / 2**30,
            )  # fmt: skip
        actors.append(
            actor_cls.options(
                num_cpus=placement.engine_share if not placement.use_gpu else 0.1,
                num_gpus=placement.engine_share if placement.use_gpu else 0,
                scheduling_strategy=bundle_strategy(pg, first.index),
            ).remote(spec)
        )
    return actors


def engine_hosts(placement: BundlePlan, bundles: list[BundleInfo]) -> list[str]:
    """Where each engine server listens: on the driver's node, loopback only; elsewhere, the
    node's address (the driver reaches it there)."""
    import ray

    driver_ip = ray.util.get_node_ip_address()
    firsts = [bundles[members[0]] for members in placement.engine_bundles]
    return ["127.0.0.1" if b.node_ip == driver_ip else b.node_ip for b in firsts]


def engine_api_key(cfg: RunConfig, hosts: list[str]) -> str | None:
    """The key of the run's engine servers: the configured one (engine.api_key, else
    AGENTRL_API_KEY); else, when a server listens beyond loopback (another node), a fresh key
    for this run -- its weight, pause and abort routes are otherwise open to the network."""
    configured = resolve_api_key(cfg.engine)
    if configured or all(host == "127.0.0.1" for host in hosts):
        return configured
    log.info("engine servers listen on %s: they want a key made for this run", sorted(set(hosts)))
    return secrets.token_urlsafe(32)


def reserve_for(placement: BundlePlan, engine: int, reserves: list[int]) -> int:
    rank = placement.colocated_rank(engine)
    return reserves[rank] if rank is not None else 0
