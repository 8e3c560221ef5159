"""`make_trainer_backend`, which builds and sets up the `TrainerBackend` (`base.py`) that
`train.backend` names."""

from __future__ import annotations

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainer.base import TrainerBackend

__all__ = ["TrainerBackend", "make_trainer_backend"]


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
        model_path,
        train_cfg,
        algo_cfg,
        device=device,
        dtype=dtype,
        temperature=temperature,
        num_optimizer_steps=num_optimizer_steps,
    )
    backend.setup()
    return backend  # type: ignore[return-value]
