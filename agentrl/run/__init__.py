"""The run layer: `train(config)` (the loop), its schedules, the runtime that drives trainer and
engines, a run's checkpoints, directory and metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.run.loop import TrainResult, train

__all__ = ["TrainResult", "train"]


def __getattr__(name: str) -> Any:
    """`train` and `TrainResult` load the loop (and torch) on first use: `agentrl train` checks
    its flags and run dir first, so a config error is one line in a fraction of a second, not
    after the 2.5 s torch takes to import."""
    if name in __all__:
        from agentrl.run import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'agentrl.run' has no attribute {name!r}")
