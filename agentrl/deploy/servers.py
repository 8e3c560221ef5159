"""The engine servers of a `Deployment` and the two `ServerExecutor`s the supervisor drives:
`LocalServer`, a SGLang subprocess of this process (engine.kind=sglang; restarted on its port), and
`RayServer`, the server of a Ray actor (`EngineServer`) on its bundle -- real SGLang or `agentrl
serve` (the same HTTP API), as the plan says -- restarted on a fresh port."""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import secrets
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.config import EngineConfig, RunConfig
from agentrl.deploy.placement_group import BundleInfo, bundle_strategy
from agentrl.deploy.plan import Deployment
from agentrl.deploy.processes import (
    ManagedProcess,
    choose_router,
    free_ports,
    keyed_env,
    require_module,
    server_command,
    wait_healthy,
)
from agentrl.deploy.supervisor import RouterOptions, ServerSupervisor
from agentrl.engine.sglang.protocol import API_KEY_ENV, resolve_api_key

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
    lora_rank: int = 0  # a LoRA run: the server takes adapters of this rank (and keeps its base)


def server_cmd(spec: ServerSpec, port: int) -> list[str]:
    if spec.use_sglang:
        cmd = server_command(
            spec.model_path,
            spec.engine,
            host=spec.host,
            port=port,
            tp_size=len(spec.device_ids),
            base_gpu_id=spec.device_ids[0] if spec.use_gpu else 0,
            enable_memory_saver=spec.is_colocated,
            api_key=spec.api_key,
        )
        if spec.lora_rank:  # SGLang loads adapters only when started for them
            cmd += ["--enable-lora", "--max-lora-rank", str(spec.lora_rank)]
            cmd += ["--lora-target-modules", "all"]
            if spec.is_colocated:  # a release keeps the base: only the adapter is sent again
                cmd += ["--enable-weights-cpu-backup"]
        return cmd
    device = f"cuda:{spec.device_ids[0]}" if spec.use_gpu else "cpu"
    return [
        sys.executable,
        "-m",
        "agentrl.cli",
        "serve",
        "--model",
        spec.model_path,
        "--host",
        spec.host,
        "--port",
        str(port),
        "--device",
        device,
        "--dtype",
        spec.dtype,
        "--max-batch-size",
        str(spec.engine.max_batch_size),
        "--mem-fraction-static",
        str(spec.engine.mem_fraction_static),
        "--reserve-gb",
        f"{spec.reserve_bytes / 2**30:.3f}",
        "--log-level",
        "warning",
        # Colocated: the trainer resends every weight after a release, no host copy needed;
        # under LoRA it sends the adapter alone, so the base must survive the release.
        "--no-weights-cpu-backup"
        if spec.is_colocated and not spec.lora_rank
        else "--weights-cpu-backup",
    ]


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
        self.url = f"http://{self.spec.host}:{port}"
        self.cmd = server_cmd(self.spec, port)
        super().start()
        wait_healthy(self, timeout_s=self.spec.health_timeout_s)
        return self.url

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


def start_engine_actors(
    cfg: RunConfig,
    plan: Deployment,
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
    use_sglang = plan.engine_server == "sglang"
    log_dir = Path(cfg.checkpoint.save) / "engine_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    actor_cls = ray.remote(EngineServer)
    actors = []
    hosts = engine_hosts(plan, bundles)
    for e, members in enumerate(plan.engine_bundles):
        first = bundles[members[0]]
        host = hosts[e]
        is_local = host == "127.0.0.1"
        spec = ServerSpec(
            index=e,
            model_path=model_path,
            device_ids=[bundles[b].device_id for b in members],
            use_gpu=plan.use_gpu,
            use_sglang=use_sglang,
            host=host,
            dtype=cfg.model.dtype,
            engine=cfg.engine,
            log_dir=str(log_dir if is_local else tempfile.gettempdir()),
            health_timeout_s=cfg.cluster.engine_start_timeout_s,
            reserve_bytes=reserve_for(plan, e, reserves),
            is_colocated=plan.is_colocated,
            api_key=api_key,
            lora_rank=cfg.train.lora_rank,
        )
        if use_sglang and spec.reserve_bytes:
            log.warning(
                "engine %d: SGLang sizes its KV cache from --mem-fraction-static alone; the trainer "
                "rank on its GPU will hold %.1f GiB more after its first step (lower "
                "engine.mem_fraction_static if the KV cache cannot resume)",
                e,
                spec.reserve_bytes / 2**30,
            )
        actors.append(
            actor_cls.options(
                num_cpus=plan.engine_share if not plan.use_gpu else 0.1,
                num_gpus=plan.engine_share if plan.use_gpu else 0,
                scheduling_strategy=bundle_strategy(pg, first.index),
            ).remote(spec)
        )
    return actors


def engine_hosts(plan: Deployment, bundles: list[BundleInfo]) -> list[str]:
    """Where each engine server listens: on the driver's node, loopback only; elsewhere, the
    node's address (the driver reaches it there)."""
    import ray

    driver_ip = ray.util.get_node_ip_address()
    firsts = [bundles[members[0]] for members in plan.engine_bundles]
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


def reserve_for(plan: Deployment, engine: int, reserves: list[int]) -> int:
    rank = plan.colocated_rank(engine)
    return reserves[rank] if rank is not None else 0


class RayServer:
    """The `ServerExecutor` of an `EngineServer` actor."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def start(self) -> str:
        return await self.actor.start.remote()

    async def is_alive(self) -> bool:
        return await self.actor.is_alive.remote()

    async def report(self) -> str:
        return await self.actor.report.remote()

    async def stop(self) -> None:
        await self.actor.stop.remote()


class LocalServer:
    """The `ServerExecutor` of a subprocess of this process, restarted on its port."""

    def __init__(self, process: ManagedProcess, health_timeout_s: float) -> None:
        self.process = process
        self.health_timeout_s = health_timeout_s
        atexit.register(process.stop)  # never leave GPU servers behind

    async def start(self) -> str:
        await asyncio.to_thread(self._start)
        return self.process.url

    def _start(self) -> None:
        self.process.stop()
        self.process.start()
        wait_healthy(self.process, timeout_s=self.health_timeout_s)

    async def is_alive(self) -> bool:
        return self.process.is_alive()

    async def report(self) -> str:
        return self.process.report()

    async def stop(self) -> None:
        self.process.stop()


def local_supervisor(
    engine: EngineConfig,
    plan: Deployment,
    model_path: str,
    *,
    health_timeout_s: float,
) -> ServerSupervisor:
    """`plan.num_engines` SGLang servers of `plan.gpus_per_engine` GPUs each (disjoint GPU ids) on
    127.0.0.1, keyed with `engine.api_key`, and a router over them if the plan says so. Port
    layout: one server listens on `engine.port`; with a router, the router takes it and the
    servers the next ports (`port=0` picks free ports). Logs go to a fresh temporary directory.
    Servers that share their GPUs with the trainer (`plan.shares_gpu`) can release memory."""
    require_module("sglang")
    if plan.use_router:
        choose_router(plan.router_policy)  # a missing router package fails before any start
    host = "127.0.0.1"
    tp_size = plan.gpus_per_engine
    api_key = engine.api_key
    count = plan.num_engines + plan.use_router
    ports = [engine.port + i for i in range(count)] if engine.port else free_ports(count, host)
    logs = Path(tempfile.mkdtemp(prefix="agentrl-sglang-"))
    servers = []
    for i, port in enumerate(ports[plan.use_router :]):
        cmd = server_command(
            model_path,
            engine,
            host=host,
            port=port,
            tp_size=tp_size,
            base_gpu_id=i * tp_size,
            enable_memory_saver=plan.shares_gpu,
            api_key=api_key,
        )
        process = ManagedProcess(
            f"sglang-server-{i}",
            f"http://{host}:{port}",
            cmd,
            logs / f"server-{i}.log",
            keyed_env(None, api_key),
        )
        servers.append(LocalServer(process, health_timeout_s))
    router = RouterOptions(logs / "router.log", plan.router_policy, port=ports[0])
    log.info("SGLang servers log to %s", logs)
    return ServerSupervisor(
        servers,
        max_restarts=plan.max_engine_restarts,
        router=router if plan.use_router else None,
        api_key=api_key,
    )
