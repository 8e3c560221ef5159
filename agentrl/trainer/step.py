"""What both trainer backends share: the checks and counters of construction, the `setup()`
contract, and the train-step driver (which steps update the weights, which only move the lr
schedule, the metrics). A backend supplies how it loads, computes logprobs, updates and keeps its
lr schedule (`TorchBackend`: torch's optimizer and schedulers; `MegatronBackend`: megatron-core's)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypeVar

import torch

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainer.backend_args import check_backend_args
from agentrl.trainer.batch import StepBatch, TrainBatch, has_advantage_free_term
from agentrl.trainer.losses import build_objective
from agentrl.trainer.offload import StateOffload

T = TypeVar("T")


class BackendBase(ABC):
    """A trainer rank. Construction only checks config; `setup()` loads the model (collectively:
    every rank calls it together, `make_trainer_backend` does), and every method but `pad_id`
    needs it."""

    device: torch.device

    def __init__(
        self,
        model_path: str,
        train_cfg: TrainConfig,
        algo_cfg: AlgoConfig,
        *,
        device: str,
        dtype: str,
        temperature: float,
        num_optimizer_steps: int | None,
    ) -> None:
        check_backend_args(train_cfg, dtype=dtype, temperature=temperature, device=device)
        self.model_path, self.train_cfg, self.algo_cfg = model_path, train_cfg, algo_cfg
        self.objective = build_objective(algo_cfg)
        self.temperature = temperature
        self.num_optimizer_steps = num_optimizer_steps or train_cfg.num_rollout
        """Optimizer steps over the run, the horizon of lr decay (pass it when global_batch_size
        splits each rollout batch into several steps)."""
        self.optimizer_step = 0
        self.num_train_steps = 0
        self._offload = StateOffload()  # the optimizer state in host memory between steps

    # ------------------------------------------------------------ what a backend supplies

    @abstractmethod
    def setup(self) -> None:
        """Load the model (and the reference model, the optimizer where it is built up front);
        a second call does nothing."""

    @abstractmethod
    def compute_logprobs(
        self, batch: TrainBatch, *, old: bool = True, ref: bool = True
    ) -> TrainBatch: ...

    @property
    @abstractmethod
    def has_ref_model(self) -> bool: ...

    @abstractmethod
    def _lr(self) -> float:
        """The lr the next optimizer step uses."""

    @abstractmethod
    def _step_schedule(self, num_steps: int) -> None:
        """Move the lr schedule `num_steps` optimizer steps on."""

    @abstractmethod
    def _update(self, step: StepBatch) -> dict[str, float]:
        """Forward, backward and (finite gradients) the optimizer's update over one step's
        micro-batches; their metrics, grad_norm and skipped_nonfinite_grad, equal on every rank."""

    def _check_batch(self, batch: TrainBatch) -> None:  # noqa: B027 (most backends take any)
        """Refuse a batch this backend cannot train on, before any work."""

    # ------------------------------------------------------------ shared

    def _ready(self, value: T | None) -> T:
        """`value`, which `setup()` builds; a clear error where nobody called it."""
        if value is None:
            raise RuntimeError(
                f"{type(self).__name__}.setup() has not run: call it once on every rank before "
                "use (make_trainer_backend does)"
            )
        return value

    def logprobs(self, batch: TrainBatch) -> TrainBatch:
        """The TrainerBackend protocol's name for `compute_logprobs`."""
        return self.compute_logprobs(batch)

    @property
    def is_state_offloaded(self) -> bool:
        return bool(self._offload)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step per `batch.steps` entry, in order. Returns the steps' mean metrics
        (loss, pg_loss, kl_loss, entropy, clip fractions, approx_kl, ratio stats, TIS and
        train-vs-rollout logprob mismatch, grad_norm, lr) and the batch counts, unprefixed.

        Old logprobs are taken before the first update when there are several steps; with one
        step the current logprobs (detached) serve, which equal them. A step none of whose
        sequences was packed (advantage 0 for all) updates nothing and moves the schedule.

        Data parallel: every rank returns the same metrics. Loss terms, clip fractions, approx_kl,
        entropy, ratio_mean and TIS stats are each rank's share of a global mean, summed over
        ranks; ratio_max/min are max/min-reduced; grad_norm is the global norm. So they equal
        the 1-rank values up to float summation order; none is a per-rank approximation.

        A batch that cannot move the weights (no trained sequence, or every advantage 0 with no KL
        or entropy term) runs no forward, backward nor update: `skipped_no_signal` is 1, loss and
        pg_loss are their exact 0, and the lr schedule advances one step per optimizer step."""
        self._check_batch(batch)
        if not self._has_signal(batch):
            return self._skip(batch)
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
                per_step.append({**self._update(step), "lr": lr})
            self._advance(1)
        self.num_train_steps += 1
        names = sorted({k for m in per_step for k in m})
        metrics = {k: _mean([m[k] for m in per_step if k in m]) for k in names}
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
        return {**_batch_counts(batch), "skipped_no_signal": 1.0, "lr": lr, "loss": 0.0,
                "pg_loss": 0.0}  # fmt: skip

    def _advance(self, num_steps: int) -> None:
        """Count optimizer steps, those that updated nothing too (a non-finite gradient, a batch
        or step without signal), so the lr schedule keeps its horizon."""
        self._step_schedule(num_steps)
        self.optimizer_step += num_steps


def check_start(token_ids: list[int], start: int) -> None:
    """`sequence_logprobs`' `start`: the first token has no logprob."""
    if not 1 <= start <= len(token_ids):
        raise ValueError(
            f"start={start} must be in [1, {len(token_ids)}] (len(token_ids)): the first "
            "token has no logprob"
        )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _batch_counts(batch: TrainBatch) -> dict[str, float]:
    return {k.removeprefix("batch/"): v for k, v in batch.metrics.items()}
