"""Placement on Ray: the placement group from slime's flags, the trainer ranks (one actor each)
and the engine servers (one per engine, supervised, routed) on it, for the run's `Runtime`.
The only package that imports `ray` (the `ray` extra)."""
