"""`RayRuntime`: the trainer group and the engine group on one Ray placement group, driven by
the loop through the `Runtime` interface. Step order as slime's `train.py`: generate ->
(colocated) engines release memory -> train -> engines resume {weights} -> update weights ->
engines resume {kv_cache, cuda_graph}."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentrl.cluster import reaper
from agentrl.cluster.engine_group import EngineGroup, start_engine_actors
from agentrl.cluster.placement import (
    BundleInfo,
    Placement,
    bundle_strategy,
    check_capacity,
    create_placement_group,
    plan_placement,
)
from agentrl.cluster.trainer_group import RankSpec, TrainerRank
from agentrl.config import ConfigError, RunConfig
from agentrl.engine.base import SamplingParams
from agentrl.rollout.gate import GatedEngine

log = logging.getLogger(__name__)

# Ray must not pick CUDA_VISIBLE_DEVICES for fractional actors: each picks its bundle's GPU itself.
_WORKER_ENV = {
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def init_ray(cfg: RunConfig, num_bundles: int) -> bool:
    """Join `cluster.ray_address` / RAY_ADDRESS, else start a local Ray for this run (on
    127.0.0.1 only, and reaped if this process dies without `ray.shutdown()`). Returns whether
    this call connected (so `ray.shutdown()` at the end: it stops a Ray started here and only
    disconnects from a cluster that was joined)."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS")
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


def _cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


class RayRuntime:
    """Trainer ranks and engine servers as Ray actors. Build with `await RayRuntime.start(...)`."""

    def __init__(
        self,
        cfg: RunConfig,
        placement: Placement,
        pg: Any,
        ranks: list[Any],
        engines: EngineGroup,
        *,
        owns_ray: bool,
    ) -> None:
        self.cfg, self.placement, self.pg, self.ranks = cfg, placement, pg, ranks
        self.engines, self.owns_ray = engines, owns_ray
        self.engine: Any = GatedEngine(engines.engine)  # a weight update drains turns, never aborts
        self.dp_ranks = list(range(len(ranks)))  # rank i trains on batches[dp_ranks[i]]
        self.dp_size = len(ranks)
        self.pad_id = 0
        self.num_engine_restarts = 0
        self.transport = _transport(cfg, placement)

    # ------------------------------------------------------------ start

    @classmethod
    async def start(cls, cfg: RunConfig, model_path: str, num_optimizer_steps: int) -> RayRuntime:
        import ray
        import torch

        _require_asked_packages(cfg)  # before anything starts
        address = cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS")
        guess = plan_placement(cfg.cluster, use_gpu=torch.cuda.is_available() and not address)
        owns_ray = init_ray(cfg, guess.num_bundles)
        try:
            use_gpu = _cluster_has_gpus()
            placement = plan_placement(cfg.cluster, use_gpu=use_gpu)
            unit = "GPU" if use_gpu else "CPU"
            available = ray.available_resources().get(unit, 0) - (0 if use_gpu else 1)
            check_capacity(placement, cfg.cluster, available)
            pg, bundles = create_placement_group(placement)
            ranks = await _start_ranks(cfg, placement, pg, bundles, model_path, num_optimizer_steps)
            reserves = [0] * len(ranks)
            if placement.is_colocated:  # the engines leave room for the ranks' optimizer state
                reserves = list(
                    await asyncio.gather(*(r.engine_reserve_bytes.remote() for r in ranks))
                )
            engines = await EngineGroup.start(
                start_engine_actors(cfg, placement, pg, bundles, model_path, reserves), cfg
            )
        except BaseException:
            if owns_ray:
                ray.shutdown()
            raise
        runtime = cls(cfg, placement, pg, ranks, engines, owns_ray=owns_ray)
        runtime.pad_id = await ranks[0].pad_id.remote()
        runtime.dp_ranks = list(
            await asyncio.gather(*(r.data_parallel_rank.remote() for r in ranks))
        )
        runtime.dp_size = max(runtime.dp_ranks) + 1
        await runtime._connect_weights()
        log.info(
            "Ray runtime: %d trainer ranks, %d engines (%s, weights by %s) at %s",
            placement.num_trainer_ranks,
            placement.num_engines,
            "colocated" if placement.is_colocated else "disaggregated",
            runtime.transport,
            engines.urls,
        )
        return runtime

    async def _connect_weights(self) -> None:
        urls = self.engines.urls
        per_rank: list[list[str]] = [[] for _ in self.ranks]
        if self.transport == "tensor" and self.placement.is_colocated:
            for e, url in enumerate(urls):
                rank = self.placement.colocated_rank(e)
                per_rank[rank if rank is not None else 0].append(url)
        else:  # rank 0 reaches every engine (broadcast group, disk, or same-host tensors)
            per_rank[0] = list(urls)
        await asyncio.gather(
            *(
                r.connect_engines.remote(u, self.transport)
                for r, u in zip(self.ranks, per_rank, strict=True)
            )
        )

    # ------------------------------------------------------------ the Runtime interface

    async def heal_engines(self) -> int:
        restarted = await self.engines.heal()
        down = self.engines.servers_down()
        if not restarted and not down:
            return 0
        self.num_engine_restarts += len(restarted)
        # New servers (new ports) join a new weight group; every engine gets the policy again.
        await self._connect_weights()
        await self._sync(self.engine.weight_version)
        self.engines.mark_all_up()
        return len(restarted)

    async def train_step(self, batches: list[Any]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.placement.is_colocated:
            before = await self._engine_memory_bytes()
            t0 = time.perf_counter()
            await self.engine.release_memory_occupation(None)
            metrics["time/release_memory_s"] = time.perf_counter() - t0
            metrics["engine/memory_before_release_gb"] = before / 1e9
            metrics["engine/memory_after_release_gb"] = await self._engine_memory_bytes() / 1e9
        results = await asyncio.gather(
            *(
                r.train_step.remote(b)
                for r, b in zip(self.ranks, batches_per_rank(batches, self.dp_ranks), strict=True)
            )
        )
        return {**results[0], **metrics}

    async def sync_weights(self, version: str) -> dict[str, float]:
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        if self.placement.is_colocated:
            await self.engine.resume_memory_occupation(["weights"])
            timings["time/resume_weights_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        sent = await self._sync(version)
        timings["time/update_weights_s"] = time.perf_counter() - t1
        timings["time/weight_export_s"] = sent["export_s"]
        timings["time/weight_send_s"] = sent["send_s"]
        if self.placement.is_colocated:
            t2 = time.perf_counter()
            await self.engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
            timings["time/resume_kv_cache_s"] = time.perf_counter() - t2
        timings["weight_sync/bytes"] = sent["bytes"]
        if self.cfg.cluster.check_weight_sync:
            timings["weight_sync/max_logprob_abs_diff"] = await self.served_weights_gap(version)
        timings["engine/num_restarts_total"] = float(self.num_engine_restarts)
        return timings

    async def served_weights_gap(self, version: str, prompt_ids: list[int] | None = None) -> float:
        """Largest |engine logprob - trainer logprob| over a few tokens each engine samples from a
        fixed prompt; raises if an engine does not report `version`."""
        prompt = prompt_ids or list(range(1, 9))
        sampling = SamplingParams(
            temperature=self.cfg.rollout.rollout_temperature, max_new_tokens=8, seed=1234
        )
        gap = 0.0
        for client in self.engine.clients:
            completion = await client.generate(prompt, sampling)
            if completion.weight_version != version:
                raise RuntimeError(
                    f"{client.base_url} serves weight version {completion.weight_version!r} after "
                    f"the sync to {version!r}"
                )
            ours = await self.policy_logprobs(prompt + completion.ids, len(prompt))
            gap = max([gap, *(abs(a - b) for a, b in zip(ours, completion.logprobs, strict=True))])
        return gap

    async def _engine_memory_bytes(self) -> float:
        """Accelerator memory engine 0 holds, as its server reports it (SGLang: the sizes of the
        parts it has not released)."""
        from agentrl.engine.sglang.protocol import memory_bytes_from_server_info

        client = self.engine.clients[0]
        info = await client.get_server_info()
        return memory_bytes_from_server_info(info, client.released_tags())

    async def _sync(self, version: str) -> dict[str, float]:
        """Rank 0's bytes and its export/send split (every rank exports; rank 0 sends most)."""
        is_paused = not self.placement.is_colocated
        # Episodes' turns being generated finish on the old weights and their next turns wait
        # (the gate); the servers' own pause holds requests from anyone else (retract: kept, not
        # aborted, and continued on the new weights).
        async with self.engine.paused():
            if is_paused:
                await asyncio.gather(
                    *(c.pause_generation(mode="retract") for c in self.engine.clients)
                )
            try:
                results = await asyncio.gather(
                    *(r.sync_weights.remote(version) for r in self.ranks)
                )
            finally:
                if is_paused:
                    await asyncio.gather(*(c.continue_generation() for c in self.engine.clients))
        self.engine.set_weight_version(version)
        return results[0]

    async def save(self, directory: Path) -> None:
        await asyncio.gather(*(r.save.remote(str(directory)) for r in self.ranks))

    async def load(self, directory: Path) -> None:
        if self.placement.is_colocated and self.cfg.cluster.offload_train:
            # the loaded optimizer state lands on the GPU before it goes to host memory; the
            # sync that follows a load resumes the engines
            await self.engine.release_memory_occupation(None)
        await asyncio.gather(*(r.load.remote(str(directory)) for r in self.ranks))

    async def policy_logprobs(self, token_ids: list[int], start: int) -> list[float]:
        """The trainer's logprobs of `token_ids[start:]` (collective over the ranks)."""
        results = await asyncio.gather(
            *(r.sequence_logprobs.remote(token_ids, start) for r in self.ranks)
        )
        return results[0]

    async def memory_allocated_bytes(self) -> list[int]:
        return list(await asyncio.gather(*(r.memory_allocated_bytes.remote() for r in self.ranks)))

    async def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            await self.engines.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.gather(*(r.shutdown.remote() for r in self.ranks)), timeout=60
            )
        for actor in [*self.ranks, *self.engines.actors]:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        with contextlib.suppress(Exception):
            remove_placement_group(self.pg)
        if self.owns_ray:
            ray.shutdown()


def batches_per_rank(batches: list[Any], dp_ranks: list[int]) -> list[Any]:
    """The batch of each trainer rank: one per data-parallel rank, shared by the tensor- and
    pipeline-parallel ranks of a Megatron replica (`dp_ranks[i]` is rank i's DP rank)."""
    if sorted(set(dp_ranks)) != list(range(len(batches))):
        raise ValueError(
            f"{len(batches)} batches for data-parallel ranks {sorted(set(dp_ranks))}: build one "
            "batch per DP rank (dp_size = trainer GPUs / (TP x PP))"
        )
    return [batches[d] for d in dp_ranks]


def _require_asked_packages(cfg: RunConfig) -> None:
    from agentrl.engine.sglang.launcher import require_module

    if importlib.util.find_spec("ray") is None:
        raise ConfigError(
            "the placement flags run trainer and engines on Ray, which is not installed: "
            "pip install 'agentrl[ray]'"
        )
    if cfg.cluster.engine_server == "sglang":
        require_module("sglang")
    if cfg.cluster.use_sglang_router and importlib.util.find_spec("smg") is None:
        require_module("sglang_router", hint="smg (or sglang_router)")


def _transport(cfg: RunConfig, placement: Placement) -> str:
    chosen = cfg.cluster.update_weight_transport
    if chosen != "auto":
        return chosen
    return "tensor" if placement.is_colocated else "distributed"


async def _start_ranks(
    cfg: RunConfig,
    placement: Placement,
    pg: Any,
    bundles: list[BundleInfo],
    model_path: str,
    num_optimizer_steps: int,
) -> list[Any]:
    import ray

    from agentrl.engine.sglang.protocol import resolve_api_key

    first = bundles[placement.trainer_bundles[0]]
    master_port = (
        await ray.remote(_free_port)
        .options(num_cpus=0.01, scheduling_strategy=bundle_strategy(pg, first.index))
        .remote()
    )
    actor_cls = ray.remote(TrainerRank)
    ranks = []
    for rank, b in enumerate(placement.trainer_bundles):
        spec = RankSpec(
            rank=rank,
            world_size=placement.num_trainer_ranks,
            device_id=bundles[b].device_id,
            use_gpu=placement.use_gpu,
            master_addr=first.node_ip,
            master_port=master_port,
            model_path=model_path,
            num_optimizer_steps=num_optimizer_steps,
            shares_device=placement.is_colocated,
            api_key=resolve_api_key(cfg.engine),
        )
        ranks.append(
            actor_cls.options(
                num_cpus=placement.trainer_share if not placement.use_gpu else 0.1,
                num_gpus=placement.trainer_share if placement.use_gpu else 0,
                scheduling_strategy=bundle_strategy(pg, bundles[b].index),
                name=None,
            ).remote(spec, cfg)
        )
    await asyncio.gather(*(r.pad_id.remote() for r in ranks))  # every rank built its model
    return ranks


def _free_port() -> int:
    from agentrl.engine.sglang.launcher import free_ports

    return free_ports(1, "0.0.0.0")[0]
