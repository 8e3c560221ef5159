"""`make_runtime`: a run's trainer and engines where its `Deployment` says, in this process (one
`TrainerWorker`, one engine object) or on Ray (`RayCluster`), behind the one `Runtime`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from agentrl.config import RunConfig
from agentrl.deploy.engines import EngineGroup, InProcessEngines, ServedEngineGroup
from agentrl.deploy.plan import Deployment, in_process_plan
from agentrl.deploy.runtime import Runtime, worker_spec
from agentrl.deploy.trainer_worker import TrainerGroup, TrainerWorker
from agentrl.engine.sglang.protocol import resolve_api_key

log = logging.getLogger(__name__)


def check_megatron(cfg: RunConfig) -> None:
    """With `--train-backend megatron`, what the machine lacks, before anything starts: the
    megatron extra, CUDA, a TP x PP that divides the trainer's GPUs, TransformerEngine for
    sequence parallel."""
    if cfg.train.backend != "megatron":
        return
    from agentrl.trainer.megatron import check_megatron_usable

    gpus = cfg.cluster.actor_num_nodes * cfg.cluster.actor_num_gpus_per_node
    check_megatron_usable(cfg.train, gpus)


async def make_runtime(cfg: RunConfig, plan: Deployment, model_path: str) -> Runtime:
    """The run's trainer and engines, started as `plan` places them; their `Runtime`."""
    num_optimizer_steps = _num_optimizer_steps(cfg)
    if plan.is_on_ray:
        return await start_on_ray(cfg, model_path, num_optimizer_steps)
    spec = worker_spec(
        cfg,
        model_path,
        num_optimizer_steps,
        shares_gpu=plan.shares_gpu,
        api_key=resolve_api_key(cfg.engine),
    )
    worker = TrainerWorker(spec, loop=asyncio.get_running_loop())
    # On a GPU the trainer loads first and the engine's KV cache leaves room for the optimizer
    # state the trainer creates at its first step, unless that state waits in host memory.
    reserve_bytes = worker.engine_reserve_bytes()
    engines = await in_process_engines(cfg, plan, model_path, reserve_bytes=reserve_bytes)
    return await _runtime(cfg, plan, TrainerGroup([worker], is_remote=False), engines).start()


async def start_on_ray(cfg: RunConfig, model_path: str, num_optimizer_steps: int) -> Runtime:
    """Trainer workers and engine servers as Ray actors on one placement group, colocated or
    disaggregated as the flags say; the runtime that drives them."""
    from agentrl.deploy.ray_cluster import RayCluster

    cluster = RayCluster.start(cfg)
    try:
        plan = cluster.plan
        specs = [
            worker_spec(
                cfg,
                model_path,
                num_optimizer_steps,
                shares_gpu=plan.shares_gpu,
                api_key=cluster.engine_api_key,
                **slot,
            )
            for slot in await cluster.rank_slots()
        ]
        trainer = TrainerGroup(await cluster.start_ranks(TrainerWorker, specs), is_remote=True)
        # the engines leave room for the optimizer state of the ranks sharing their GPUs
        engines = await cluster.start_engines(model_path, await trainer.engine_reserve_bytes())
        runtime = _runtime(cfg, plan, trainer, engines, on_close=cluster.release)
        await runtime.start()
    except BaseException:
        cluster.release()
        raise
    log.info(
        "Ray runtime: %d trainer ranks, %d engines (%s, weights by %s) at %s",
        plan.num_trainer_ranks,
        len(engines.urls),
        plan.kind,
        plan.transport,
        engines.urls,
    )
    return runtime


def _runtime(
    cfg: RunConfig,
    plan: Deployment,
    trainer: TrainerGroup,
    engines: EngineGroup,
    on_close: Callable[[], None] | None = None,
) -> Runtime:
    return Runtime(
        plan,
        trainer,
        engines,
        temperature=cfg.rollout.rollout_temperature,
        check_weight_sync=cfg.cluster.check_weight_sync,
        on_close=on_close,
    )


async def in_process_engines(
    cfg: RunConfig, plan: Deployment, model_path: str, *, reserve_bytes: int = 0
) -> EngineGroup:
    """The engines of a run without Ray: an engine object (local, or a client of engine.url), or
    SGLang servers launched from this process, healthy, which their group supervises and stops.
    `reserve_bytes`: what the local engine leaves for the trainer beside it."""
    from agentrl.deploy.servers import local_supervisor
    from agentrl.engine.factory import make_engine

    if plan.engine_server != "sglang":
        engine = make_engine(cfg, model_path=model_path, reserve_bytes=reserve_bytes)
        return InProcessEngines(engine)
    engine_cfg = dataclasses.replace(cfg.engine, api_key=resolve_api_key(cfg.engine))
    timeout_s = cfg.cluster.engine_start_timeout_s
    supervisor = local_supervisor(engine_cfg, plan, model_path, health_timeout_s=timeout_s)
    return await ServedEngineGroup.start(supervisor, engine_cfg, cfg.rollout, plan)


async def open_engines(cfg: RunConfig) -> EngineGroup:
    """`agentrl eval` and `rollout`'s engines: engine.kind's, in this process, whatever the
    placement flags say, sharing a GPU with no trainer. Close the group to stop them."""
    from agentrl.engine.factory import make_engine
    from agentrl.model_store import resolve_model_path

    if cfg.engine.kind != "sglang":
        return InProcessEngines(make_engine(cfg))
    model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    return await in_process_engines(cfg, in_process_plan(cfg, use_gpu=False), model_path)


def _num_optimizer_steps(cfg: RunConfig) -> int:
    """The learning-rate schedule's horizon: optimizer steps over the whole run."""
    per_rollout = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    gbs = cfg.train.global_batch_size or per_rollout
    return cfg.train.num_rollout * -(-per_rollout // gbs)
