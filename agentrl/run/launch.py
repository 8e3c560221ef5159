"""`make_runtime`: a run's trainer and engines, in this process (one `TrainerWorker`, one engine
object) or on Ray (`agentrl.cluster`), behind the one `Runtime`."""

from __future__ import annotations

import asyncio
import logging

from agentrl.config import RunConfig
from agentrl.config_checks import trainer_uses_cuda, uses_ray
from agentrl.run.engines import InProcessEngines
from agentrl.run.runtime import Runtime, make_placement, worker_spec
from agentrl.run.trainer_worker import TrainerGroup, TrainerWorker

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


def shares_trainer_gpu(cfg: RunConfig) -> bool:
    """In one process: an engine in this process, or servers agentrl launched, share the
    trainer's GPU and take turns with its memory; a remote `engine.kind=http` server does not."""
    return trainer_uses_cuda(cfg.model.device) and cfg.engine.kind != "http"


async def make_runtime(cfg: RunConfig, model_path: str) -> Runtime:
    num_optimizer_steps = _num_optimizer_steps(cfg)
    if uses_ray(cfg):
        return await start_on_ray(cfg, model_path, num_optimizer_steps)
    from agentrl.engine.factory import make_engine

    shares_gpu = shares_trainer_gpu(cfg)
    spec = worker_spec(cfg, model_path, num_optimizer_steps, shares_gpu=shares_gpu)
    worker = TrainerWorker(spec, loop=asyncio.get_running_loop())
    # On a GPU the trainer loads first and the engine's KV cache leaves room for the optimizer
    # state the trainer creates at its first step, unless that state waits in host memory.
    engine = make_engine(cfg, model_path=model_path, reserve_bytes=worker.engine_reserve_bytes())
    trainer = TrainerGroup([worker], is_remote=False)
    runtime = Runtime(
        make_placement(cfg.cluster, "in_process", shares_gpu),
        trainer,
        InProcessEngines(engine),
        temperature=cfg.rollout.rollout_temperature,
        check_weight_sync=cfg.cluster.check_weight_sync,
    )
    return await runtime.start()


async def start_on_ray(cfg: RunConfig, model_path: str, num_optimizer_steps: int) -> Runtime:
    """Trainer workers and engine servers as Ray actors on one placement group, colocated or
    disaggregated as the flags say; the runtime that drives them."""
    from agentrl.cluster.runtime import RayCluster

    cluster = RayCluster.start(cfg)
    try:
        plan = cluster.plan
        specs = [
            worker_spec(cfg, model_path, num_optimizer_steps, shares_gpu=plan.is_colocated,
                        api_key=cluster.engine_api_key, **slot)
            for slot in await cluster.rank_slots()
        ]  # fmt: skip
        trainer = TrainerGroup(await cluster.start_ranks(TrainerWorker, specs), is_remote=True)
        # the engines leave room for the optimizer state of the ranks sharing their GPUs
        engines = await cluster.start_engines(model_path, await trainer.all("engine_reserve_bytes"))
        kind = "colocated" if plan.is_colocated else "disaggregated"
        placement = make_placement(cfg.cluster, kind, shares_gpu=plan.is_colocated)
        runtime = Runtime(
            placement,
            trainer,
            engines,
            temperature=cfg.rollout.rollout_temperature,
            check_weight_sync=cfg.cluster.check_weight_sync,
            on_close=cluster.release,
        )
        await runtime.start()
    except BaseException:
        cluster.release()
        raise
    log.info(
        "Ray runtime: %d trainer ranks, %d engines (%s, weights by %s) at %s",
        plan.num_trainer_ranks, len(engines.urls), placement.kind, placement.transport, engines.urls,
    )  # fmt: skip
    return runtime


def _num_optimizer_steps(cfg: RunConfig) -> int:
    """The learning-rate schedule's horizon: optimizer steps over the whole run."""
    per_rollout = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    gbs = cfg.train.global_batch_size or per_rollout
    return cfg.train.num_rollout * -(-per_rollout // gbs)
