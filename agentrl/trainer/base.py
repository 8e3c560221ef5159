"""`TrainerBackend`: what the loop and the cluster layer ask of a trainer rank, and the part of
it both backends share: the checks of construction, the `setup()` contract, the train-step driver
(which steps update the weights, which only move the lr schedule, the metrics and their reduction
over data-parallel ranks), teacher-forced logprobs and bucketed weight export. A backend
(`TorchBackend`, `MegatronBackend`) supplies how it loads, computes logprobs, updates and keeps
its lr schedule (`backend.make_trainer_backend` builds and sets up the one `train.backend`
names; a module of its own so the backends import this one without a cycle)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from agentrl.config import AlgoConfig, ClusterConfig, ConfigError, TrainConfig
from agentrl.model_store import resolve_device
from agentrl.trainer.batch import (
    MicroBatch,
    StepBatch,
    TrainBatch,
    has_advantage_free_term,
    pad_id_for,
)
from agentrl.trainer.losses import build_objective, combine_metrics, diagnostic_means
from agentrl.trainer.offload import StateOffload
from agentrl.weights.adapter import AdapterExport
from agentrl.weights.buckets import packed_buckets


def check_backend_args(*, dtype: str, temperature: float, device: str) -> torch.device:
    """What every backend refuses before it looks at the machine or loads anything (a
    `ConfigError`: the command line prints it as one line); the device, auto resolved."""
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"dtype={dtype!r} is not supported; use auto, float32 or bfloat16")
    if temperature <= 0:
        raise ConfigError(f"temperature={temperature} must be > 0 (use 1.0 for greedy rollouts)")
    try:
        return torch.device(resolve_device(device))
    except ValueError as e:  # it names the value; the field is model.device
        raise ConfigError(f"model.{e}") from None


T = TypeVar("T")


class TrainerBackend(ABC):
    """One trainer rank on the checkpoint directory `model_path` (the run layer resolved a
    bundled name once). Construction only checks config (and the machine); `setup()` loads the
    model, collectively (every rank calls it together; `make_trainer_backend` does). With several
    ranks in a torch.distributed group every method but `pad_id` is collective: all ranks call it
    together, with the same arguments (for `compute_logprobs` and `train_step`, each rank its own
    batch of `build_train_batches(..., dp_size)`).

    A backend supplies the abstract methods: `_lr` is the lr the next optimizer step uses,
    `_step_schedule(n)` moves the schedule n steps on, `_update` runs one step's forward, backward
    and (finite gradients) update and returns its metrics, equal on every rank; `_hf_tensors`
    yields (HF name, whole tensor) on every rank."""

    auto_dtype: torch.dtype  # the parameters' dtype for dtype="auto"

    def __init__(
        self,
        model_path: str,
        train_cfg: TrainConfig,
        algo_cfg: AlgoConfig,
        *,
        device: str = "auto",
        dtype: str = "auto",
        temperature: float = 1.0,
        num_optimizer_steps: int | None = None,
    ) -> None:
        self.device = check_backend_args(dtype=dtype, temperature=temperature, device=device)
        self._check_machine(train_cfg)
        self.model_path = model_path
        self.train_cfg = train_cfg
        self.algo_cfg = algo_cfg
        self.objective = build_objective(algo_cfg)
        self.param_dtype: torch.dtype = (
            getattr(torch, dtype) if dtype != "auto" else self.auto_dtype
        )
        self.temperature = temperature
        self.num_optimizer_steps = num_optimizer_steps or train_cfg.num_rollout
        """Optimizer steps over the run, the horizon of lr decay (pass it when global_batch_size
        splits each rollout batch into several steps)."""
        self.optimizer_step = 0
        self.num_train_steps = 0
        self._offload = StateOffload()  # the optimizer state in host memory between steps

    def _check_machine(self, train_cfg: TrainConfig) -> None:  # noqa: B027 (torch runs anywhere)
        """Refuse a machine this backend cannot run on, before anything loads."""

    @abstractmethod
    def setup(self) -> None:
        """Load the model (a second call does nothing). Collective."""

    @abstractmethod
    def compute_logprobs(
        self, batch: TrainBatch, *, old: bool = True, ref: bool = True
    ) -> TrainBatch:
        """Fill every micro-batch's `old_logprobs` (`old`) and, with a reference model, its
        `ref_logprobs` (`ref`)."""

    @property
    def has_ref_model(self) -> bool:
        """A KL term is trained: `setup()` loads the reference model its logprobs come from (under
        LoRA the base itself is the reference, its adapters switched off)."""
        return self.objective.kl is not None

    @abstractmethod
    def _lr(self) -> float: ...

    @abstractmethod
    def _step_schedule(self, num_steps: int) -> None: ...

    @abstractmethod
    def _update(self, step: StepBatch) -> dict[str, float]: ...

    @abstractmethod
    def _hf_tensors(self, dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]: ...

    @abstractmethod
    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose state a step creates (none while unbuilt)."""

    def pending_state_bytes(self) -> int:
        """Device bytes this rank will still allocate and keep between steps: Adam's two moments
        per parameter the optimizers step (this rank's shard), created at the first step (0 once
        they exist). A colocated engine sizes its KV cache without them."""
        optimizers = self._optimizers()
        if any(o.state for o in optimizers):
            return 0
        params = [p for o in optimizers for group in o.param_groups for p in group["params"]]
        return sum(2 * _local(p).numel() * p.element_size() for p in params)

    def adapter_size_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the trained LoRA adapter in `dtype`, what an adapter-only weight sync sends;
        0 for a backend training all weights."""
        return 0

    def export_adapter(self, *, dtype: torch.dtype | None = None) -> AdapterExport:
        """The LoRA adapter alone (`agentrl.weights.adapter`'s format; collective)."""
        raise RuntimeError(
            "export_adapter() needs train.lora_rank > 0 (this run trains all weights)"
        )

    def free_step_memory(self) -> None:
        """After a step on a GPU an engine shares: hand back the allocator's cached blocks (and
        the gradients, where they are not kept in a persistent buffer), so the engine's KV cache
        can resume into them."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def offload_state(self) -> None:
        """The optimizer state (Adam's moments) to pinned host memory, its blocks back to the
        device, where a colocated engine's KV cache takes them between steps (slime's
        --offload-train). The next `train_step` brings it back; `save` writes it from the host;
        `load` replaces it. A no-op on CPU and before the first step."""
        if self.device.type == "cuda":
            self._offload.offload(self._optimizers())

    @abstractmethod
    def save(self, directory: str | Path) -> None:
        """Sharded model + optimizer state, loadable on any number of ranks, plus an HF copy."""

    @abstractmethod
    def load(self, directory: str | Path) -> None:
        """Restore what `save` wrote (possibly with another number of ranks)."""

    @cached_property
    def hf_config(self) -> Any:
        """The checkpoint's transformers config, read without loading the model."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.model_path)

    @property
    def pad_id(self) -> int:
        """An id for padding rows. Pads are never attended to by real tokens nor trained, so any
        valid id works: the config's pad, else eos, else 0. Asking never loads the model."""
        return pad_id_for(self.hf_config)

    def _ready(self, value: T | None) -> T:
        """`value`, which `setup()` builds; a clear error where nobody called it."""
        if value is None:
            raise RuntimeError(
                f"{type(self).__name__}.setup() has not run: call it once on every rank before "
                "use (make_trainer_backend does)"
            )
        return value

    def _counters(self, **extra: Any) -> dict[str, Any]:
        """What a checkpoint's trainer_state.json holds: the step counters, the base model and
        the backend's `extra`."""
        return {
            "optimizer_step": self.optimizer_step,
            "num_train_steps": self.num_train_steps,
            "base_model_path": self.model_path,
            **extra,
        }

    def _restore_counters(self, counters: dict[str, Any]) -> None:
        self.optimizer_step = int(counters["optimizer_step"])
        self.num_train_steps = int(counters["num_train_steps"])

    @property
    def is_state_offloaded(self) -> bool:
        return bool(self._offload)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step per `batch.steps` entry, in order. Returns the steps' mean metrics
        (loss, pg_loss, kl_loss over the loss's denominators; entropy, clip fractions, approx_kl,
        ratio stats, TIS and train-vs-rollout logprob mismatch over the `num_packed_loss_tokens`
        that had logprobs, so a tied group left unpacked dilutes none; grad_norm, lr) and the
        batch counts, unprefixed.

        Old logprobs are taken before the first update when there are several steps; with one
        step the current logprobs (detached) serve, which equal them. A step none of whose
        sequences was packed (advantage 0 for all) updates nothing and moves the schedule.

        Data parallel: every rank returns the same metrics (`reduce_metrics`), equal to the
        1-rank values up to float summation order; none is a per-rank approximation.

        A batch that cannot move the weights (no trained sequence, or every advantage 0 with no KL
        or entropy term) runs no forward, backward nor update: `skipped_no_signal` is 1, loss and
        pg_loss are their exact 0, and the lr schedule advances one step per optimizer step."""
        if not self._has_signal(batch):
            return self._skip(batch)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._offload.reload()
        mbs = list(batch.micro_batches())
        need_old = len(batch.steps) > 1 and any(mb.old_logprobs is None for mb in mbs)
        need_ref = self.has_ref_model and any(mb.ref_logprobs is None for mb in mbs)
        if need_old or need_ref:
            self.compute_logprobs(batch, old=need_old, ref=need_ref)
        per_step = []
        for step in batch.steps:
            lr = self._lr()
            if step.micro_batches:
                per_step.append({**diagnostic_means(self._update(step)), "lr": lr})
            self._advance(1)
        self.num_train_steps += 1
        names = sorted({k for m in per_step for k in m})
        metrics = {k: _mean([m[k] for m in per_step if k in m]) for k in names}
        if self.device.type == "cuda":  # this rank's peak: LoRA's saving against full tuning
            metrics["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        return {**metrics, **_batch_counts(batch), "skipped_no_signal": 0.0}

    def _has_signal(self, batch: TrainBatch) -> bool:
        """Whether the batch gives a gradient: zero advantages zero the policy loss exactly, but
        a KL or entropy term pulls on the weights whatever the advantages."""
        if not any(step.micro_batches for step in batch.steps):
            return False
        return has_advantage_free_term(self.algo_cfg) or batch.max_abs_advantage > 0

    def _skip(self, batch: TrainBatch) -> dict[str, float]:
        """No compute for a batch without signal. Adam's moments and weight decay stay put too:
        an update from old momentum alone would not be learning from this batch."""
        lr = self._lr()
        self._advance(len(batch.steps))  # the lr schedule keeps its horizon
        self.num_train_steps += 1
        # Exact, not a stand-in: every per-token loss is 0 (advantage 0, no KL or entropy term).
        return {
            **_batch_counts(batch),
            "skipped_no_signal": 1.0,
            "lr": lr,
            "loss": 0.0,
            "pg_loss": 0.0,
        }

    def _advance(self, num_steps: int) -> None:
        """Count optimizer steps, those that updated nothing too (a non-finite gradient, a batch
        or step without signal), so the lr schedule keeps its horizon."""
        self._step_schedule(num_steps)
        self.optimizer_step += num_steps

    @torch.no_grad()
    def sequence_logprobs(
        self, token_ids: list[int], start: int, masks: tuple[list[int], list[float]] | None = None
    ) -> list[float]:
        """Teacher-forced logprob of token_ids[t] for each t >= start under the current weights,
        float32 log_softmax(logits / temperature) as the engine computes it, under the top-k/top-p
        `masks` of each target if given (`batch.sampling_masks`). Collective."""
        if not 1 <= start <= len(token_ids):
            raise ValueError(
                f"start={start} must be in [1, {len(token_ids)}] (len(token_ids)): the first "
                "token has no logprob"
            )
        if start == len(token_ids):
            return []
        ids = torch.tensor([token_ids])
        n = len(token_ids) - 1
        # Position t predicts token t+1, so the trained positions start at start - 1.
        mask = (torch.arange(n) >= start - 1).float()[None]
        zeros = torch.zeros(1, n)
        mb = MicroBatch(
            ids[:, :-1],
            torch.arange(n)[None],
            ids[:, 1:],
            mask,
            zeros,
            zeros,
            torch.zeros(1, n, dtype=torch.long),
            mask.sum(-1),
            [0],
            top_k=None if masks is None else torch.tensor([masks[0]], dtype=torch.long),
            top_p=None if masks is None else torch.tensor([masks[1]]),
        )
        self.compute_logprobs(TrainBatch([StepBatch([mb], n, 1)]), ref=False)
        assert mb.old_logprobs is not None  # compute_logprobs filled it
        return mb.old_logprobs[0, start - 1 :].tolist()

    def export_weights(
        self,
        bucket_size_bytes: int = ClusterConfig.update_weight_buffer_size,
        *,
        dtype: torch.dtype | None = None,
    ) -> Iterator[list[tuple[str, Tensor]]]:
        """Per-dtype buckets of (HF name, whole tensor) of at most `bucket_size_bytes` (a larger
        tensor alone), a tied lm_head left out, each bucket one flat buffer in `dtype` (floats).
        Collective and lazy: every rank iterates to the end together, and every rank receives
        every tensor."""
        return packed_buckets(self._hf_tensors(dtype), bucket_size_bytes, dtype=dtype)


def reduce_metrics(metrics: dict[str, float], group: Any = None) -> dict[str, float]:
    """One optimizer step's per-rank metrics (shares of global means) combined over the ranks of
    `group` (None: all) as over micro-batches (`combine_metrics`: sums, max/min for extremes; a
    rank whose micro-batches are all empty has no extremes). Every rank gets the same values."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return metrics
    ranks: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, metrics, group=group)  # on NCCL: torch.cuda.current_device()
    return combine_metrics(ranks)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _batch_counts(batch: TrainBatch) -> dict[str, float]:
    return {k.removeprefix("batch/"): v for k, v in batch.metrics.items()}


def _local(param: Tensor) -> Tensor:
    """This rank's shard of an FSDP2 (DTensor) parameter; a plain tensor as it is."""
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param
