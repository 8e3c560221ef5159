"""What the engine says of its KV arena: on CPU the arena is address space, not memory taken."""

from __future__ import annotations

import logging

from agentrl.engine.local import LocalEngine


async def test_the_cpu_arena_is_called_virtual(tiny_model_path, caplog):
    """The arena line said "24.5 GB" on a 23 GB machine without saying the pages are committed
    only as slots are written."""
    with caplog.at_level(logging.INFO, logger="agentrl.engine.local.engine"):
        engine = LocalEngine.load(tiny_model_path, device="cpu", dtype="float32", max_batch_size=2)
    await engine.close()
    (line,) = [r.getMessage() for r in caplog.records if "KV arena" in r.getMessage()]
    assert "virtual, committed as written" in line and "reserved" not in line
