"""Inference engines: the `Engine` protocol, the in-process transformers engine, the SGLang client."""

from agentrl.engine.base import (
    Completion,
    Engine,
    EngineError,
    EngineMemoryError,
    EngineUnavailable,
    FinishReason,
    SamplingParams,
)

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "EngineMemoryError",
    "EngineUnavailable",
    "FinishReason",
    "SamplingParams",
]
