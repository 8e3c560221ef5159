"""`Runtime`: the trainer's workers and the run's engines, and the one step choreography between
them, as slime's `train.py` runs it: (engines sharing the trainer's GPUs release their memory) ->
train -> resume weights -> push weights, under the pause gate -> resume KV cache. Where they live
is the run's `Deployment` (`agentrl.deploy.plan`): in this process (the laptop default), or on
Ray, colocated or disaggregated; `agentrl.deploy.launch` builds the runtime for a run."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.config import RunConfig
from agentrl.deploy.engines import EngineGroup
from agentrl.deploy.plan import Deployment
from agentrl.deploy.trainer_worker import TrainerGroup, WorkerSpec
from agentrl.engine.base import SamplingParams
from agentrl.timing import timed
from agentrl.weights.adapter import adapter_name

if TYPE_CHECKING:
    from agentrl.trainer.batch import TrainBatch


class Runtime:
    """What the loop drives: `engine` (episodes generate with it), `train_step`, `sync_weights`,
    `heal_engines`, `policy_logprobs`, `save`/`load`. Built by `agentrl.deploy.launch`."""

    def __init__(
        self,
        plan: Deployment,
        trainer: TrainerGroup,
        engines: EngineGroup,
        *,
        temperature: float,
        check_weight_sync: bool,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.plan = plan
        self.trainer = trainer
        self.engines = engines
        # A `GatedEngine` (the Engine protocol by delegation): a weight update drains turns.
        self.engine: Any = engines.engine
        self.temperature = temperature
        self.check_weight_sync = check_weight_sync
        self.on_close = on_close
        self.pad_id = 0
        self.dp_ranks = [0] * len(trainer.workers)  # worker i trains on batches[dp_ranks[i]]
        self.dp_size = 1
        self.num_engine_restarts = 0
        self._is_released = False

    async def start(self) -> Runtime:
        """Every worker built its model; the batch each trains on; the weights' routes."""
        self.pad_id = await self.trainer.pad_id()
        self.dp_ranks = await self.trainer.data_parallel_ranks()
        self.dp_size = max(self.dp_ranks) + 1
        await self._connect_weights()
        return self

    async def _connect_weights(self) -> None:
        transport = self.plan.transport
        targets = self.engines.weight_targets(len(self.trainer.workers), transport)
        await self.trainer.connect_engines(targets, transport)

    # ------------------------------------------------------------ the step

    async def train_step(self, batches: list[TrainBatch]) -> dict[str, float]:
        metrics = await self._release_engines() if self.plan.shares_gpu else {}
        per_worker = batches_per_rank(batches, self.dp_ranks)
        results = await self.trainer.train_step(per_worker)
        return {**results, **metrics}

    async def _release_engines(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        before = await self.engines.memory_bytes()
        with timed(metrics, "time/release_memory_s"):
            await self.engines.release_memory()
        self._is_released = True
        after = await self.engines.memory_bytes()
        if before is not None and after is not None:
            metrics["engine/memory_before_release_gb"] = before / 1e9
            metrics["engine/memory_after_release_gb"] = after / 1e9
        return metrics

    async def sync_weights(self, version: int) -> dict[str, float]:
        """Push the trainer's weights to every engine, stamped `version`; returns timings."""
        timings: dict[str, float] = {}
        if self._is_released:  # weights first: the KV cache never sits beside the buckets
            with timed(timings, "time/resume_weights_s"):
                await self.engines.resume_memory(["weights"])
        sent = await self._push(version, timings)
        timings["weight_sync/bytes"] = sent.pop("bytes")
        if adapter_bytes := sent.pop("adapter_bytes", 0.0):  # LoRA: the adapter alone was sent
            timings["weight_sync/adapter_bytes"] = adapter_bytes
        timings.update({f"time/weight_{phase}": s for phase, s in sent.items()})  # export, send...
        if self.check_weight_sync and self.engines.servers():
            timings["weight_sync/max_logprob_abs_diff"] = await self.served_weights_gap(version)
        timings["engine/num_restarts_total"] = float(self.num_engine_restarts)
        return timings

    async def _push(self, version: int, timings: dict[str, float]) -> dict[str, float]:
        """Turns being generated finish on the old weights and the next ones wait (the gate);
        disaggregated servers also hold everyone else's requests (retract: kept, not aborted,
        and continued on the new weights). Rank 0's bytes and its export/send split."""
        async with contextlib.AsyncExitStack() as gate:
            with timed(timings, "time/weight_sync_drain_s"):
                await gate.enter_async_context(self.engine.paused())
            with timed(timings, "time/update_weights_s"):
                if self.plan.pauses_servers:
                    await self.engines.pause_generation("retract")
                try:
                    sent = await self.trainer.send_weights(version)
                    if sent.get("adapter_bytes"):  # LoRA: rollouts name the version's adapter
                        for client in self.engines.servers():
                            client.lora_name = adapter_name(version)
                finally:
                    if self.plan.pauses_servers:
                        await self.engines.continue_generation()
                self.engines.set_weight_version(version)
            if self._is_released:
                with timed(timings, "time/resume_kv_cache_s"):
                    await self.engines.resume_memory(["kv_cache", "cuda_graph"])
                self._is_released = False
        return sent

    async def heal_engines(self) -> int:
        """Restart dead engine servers and bring them to the policy's weights; returns how many."""
        restarted = await self.engines.heal()
        if not restarted and not self.engines.servers_down():
            return 0
        self.num_engine_restarts += len(restarted)
        # New servers (new ports) join a new weight group; every engine gets the policy again.
        await self._connect_weights()
        await self._push(self.engines.weight_version, {})
        self.engines.mark_all_up()
        return len(restarted)

    async def served_weights_gap(self, version: int) -> float:
        """Largest |engine logprob - trainer logprob| over a few tokens each server samples from
        a fixed prompt; raises if a server does not report `version`."""
        prompt = list(range(1, 9))
        sampling = SamplingParams(temperature=self.temperature, max_new_tokens=8, seed=1234)
        gap = 0.0
        for client in self.engines.servers():
            completion = await client.generate(prompt, sampling)
            if completion.weight_version != version:
                raise RuntimeError(
                    f"{client.base_url} serves weight version {completion.weight_version!r} after "
                    f"the sync to {version!r}"
                )
            ours = await self.policy_logprobs(prompt + completion.ids, len(prompt))
            gap = max([gap, *(abs(a - b) for a, b in zip(ours, completion.logprobs, strict=True))])
        return gap

    async def policy_logprobs(
        self, token_ids: list[int], start: int, masks: tuple[list[int], list[float]] | None = None
    ) -> list[float]:
        """The trainer's logprobs of `token_ids[start:]` (collective over the workers); `masks`:
        the top-k / top-p filter each target was sampled under, replayed."""
        return await self.trainer.sequence_logprobs(token_ids, start, masks)

    async def save(self, directory: Path) -> None:
        await self.trainer.save(str(directory))

    async def load(self, directory: Path) -> None:
        if self.plan.shares_gpu and self.plan.offload_train:
            # the loaded optimizer state lands on the GPU before it goes to host memory; the
            # sync that follows a load resumes the engines
            await self.engines.release_memory()
            self._is_released = True
        await self.trainer.load(str(directory))

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.engines.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.trainer.shutdown(), timeout=60)
        if self.on_close is not None:
            self.on_close()


def batches_per_rank(batches: list[Any], dp_ranks: list[int]) -> list[Any]:
    """The batch of each trainer rank: one per data-parallel rank, shared by the tensor- and
    pipeline-parallel ranks of a Megatron replica (`dp_ranks[i]` is rank i's DP rank)."""
    if sorted(set(dp_ranks)) != list(range(len(batches))):
        raise ValueError(
            f"{len(batches)} batches for data-parallel ranks {sorted(set(dp_ranks))}: build one "
            "batch per DP rank (dp_size = trainer GPUs / (TP x PP))"
        )
    return [batches[d] for d in dp_ranks]


def worker_spec(cfg: RunConfig, model_path: str, num_optimizer_steps: int, **kw: Any) -> WorkerSpec:
    """A worker's spec from the run's sections (`kw`: its rank, device and group)."""
    return WorkerSpec(
        model_path=model_path,
        train=cfg.train,
        algo=cfg.algo,
        dtype=cfg.model.dtype,
        device=kw.pop("device", cfg.model.device),
        temperature=cfg.rollout.rollout_temperature,
        num_optimizer_steps=num_optimizer_steps,
        bucket_bytes=cfg.cluster.update_weight_buffer_size,
        offload_train=cfg.cluster.offload_train,
        **kw,
    )
