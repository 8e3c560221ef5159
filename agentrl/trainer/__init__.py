"""The trainer: pure losses and advantages, `TrainBatch` packing, `TrainerBackend` (the base both
backends share: setup, the train-step driver, export) and its torch backend (FSDP2 across ranks),
weight export, checkpoints."""

from agentrl.trainer.base import TrainerBackend
from agentrl.trainer.batch import (
    MicroBatch,
    StepBatch,
    TrainBatch,
    build_train_batches,
    compute_advantages,
)
from agentrl.trainer.checkpoint import find_latest, save_checkpoint
from agentrl.trainer.losses import build_objective
from agentrl.trainer.torch_backend import TorchBackend

__all__ = [
    "MicroBatch",
    "StepBatch",
    "TorchBackend",
    "TrainBatch",
    "TrainerBackend",
    "build_objective",
    "build_train_batches",
    "compute_advantages",
    "find_latest",
    "save_checkpoint",
]
