"""The run layer: `train(config)` (the loop), its schedules, the runtime that drives trainer and
engines, a run's checkpoints, directory and metrics."""

from agentrl.run.loop import TrainResult, train

__all__ = ["TrainResult", "train"]
