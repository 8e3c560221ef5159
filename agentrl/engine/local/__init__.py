"""The embedded engine: `LocalEngine` (continuous batching over a transformers model), its scheduler,
KV arena, attention over the arena, CUDA-graph decode and sampler."""

from agentrl.engine.local.engine import EngineStats, LocalEngine, LocalEngineOptions

__all__ = ["EngineStats", "LocalEngine", "LocalEngineOptions"]
