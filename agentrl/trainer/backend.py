"""The `TrainerBackend` protocol: what the loop and the cluster layer ask of a trainer rank; and
`make_trainer_backend`, which builds the one `train.backend` names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainer.batch import TrainBatch


@runtime_checkable
class TrainerBackend(Protocol):
    """One trainer rank. With several ranks in a torch.distributed group, every method but
    `pad_id` is collective: all ranks call it together, with the same arguments (for `logprobs`
    and `train_step`, each rank its own batch of `build_train_batches(..., dp_size)`)."""

    device: torch.device  # where this rank computes

    @property
    def pad_id(self) -> int:
        """A token id for padding rows (never attended to, never trained)."""
        ...

    def logprobs(self, batch: TrainBatch) -> TrainBatch:
        """Fill every micro-batch's `old_logprobs` (and `ref_logprobs` with a reference model)."""
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step per `batch.steps` entry; metrics equal on every rank."""
        ...

    def pending_state_bytes(self) -> int:
        """Device bytes this rank will still allocate and keep between steps: its optimizer
        state, created at the first step (0 once it exists). A colocated engine sizes its KV
        cache without them."""
        ...

    def free_step_memory(self) -> None:
        """After a step on a GPU an engine shares: hand back the gradients (when they are not
        kept in a persistent buffer) and the allocator's cached blocks, so the engine's KV cache
        can resume into them."""
        ...

    def export_weights(
        self, bucket_size_bytes: int = ..., dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, Tensor]]]:
        """Per-dtype buckets of (HF name, whole tensor); every rank receives every tensor."""
        ...

    def sequence_logprobs(self, token_ids: list[int], start: int) -> list[float]:
        """float32 log_softmax(logits / temperature) of token_ids[t] for t >= start, teacher-forced
        under the current weights (the engine's definition, to check a weight sync)."""
        ...

    def offload_state(self) -> None:
        """Move the optimizer state to host memory until the next `train_step` (a no-op on CPU
        and before the first step); `save` writes it from there."""
        ...

    def save(self, directory: str | Path) -> None:
        """Sharded model + optimizer state, loadable on any number of ranks, plus an HF copy."""
        ...

    def load(self, directory: str | Path) -> None:
        """Restore what `save` wrote (possibly with another number of ranks)."""
        ...


def make_trainer_backend(
    model_path: str,
    train_cfg: TrainConfig,
    algo_cfg: AlgoConfig,
    *,
    device: str,
    dtype: str,
    temperature: float,
    num_optimizer_steps: int | None = None,
) -> TrainerBackend:
    """`train.backend`'s backend for one rank, set up (the model loaded: collective, every rank
    calls this together); megatron.core is imported only when asked for."""
    if train_cfg.backend == "megatron":
        from agentrl.trainer.megatron.backend import MegatronBackend as backend_cls
    else:
        from agentrl.trainer.torch_backend import TorchBackend as backend_cls
    backend = backend_cls(
        model_path, train_cfg, algo_cfg, device=device, dtype=dtype, temperature=temperature,
        num_optimizer_steps=num_optimizer_steps,
    )  # fmt: skip
    backend.setup()
    return backend  # type: ignore[return-value]
