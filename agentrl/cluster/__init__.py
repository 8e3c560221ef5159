"""Placement on Ray: the placement group from slime's flags, the trainer group (one actor per
rank), the engine group (one server per engine, supervised) and the weight sync between them.
The only package that imports `ray` (the `ray` extra)."""

from agentrl.cluster.runtime import RayRuntime

__all__ = ["RayRuntime"]
