"""The trainer: pure losses and advantages, `TrainBatch` packing, the torch backend, checkpoints."""

from agentrl.trainer.batch import (
    MicroBatch,
    StepBatch,
    TrainBatch,
    build_train_batch,
    compute_advantages,
    filter_zero_variance_groups,
)
from agentrl.trainer.checkpoint import find_latest, save_checkpoint
from agentrl.trainer.losses import build_objective
from agentrl.trainer.torch_backend import TorchBackend

__all__ = [
    "MicroBatch",
    "StepBatch",
    "TorchBackend",
    "TrainBatch",
    "build_objective",
    "build_train_batch",
    "compute_advantages",
    "filter_zero_variance_groups",
    "find_latest",
    "save_checkpoint",
]
