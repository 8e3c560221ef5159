"""`timed`: a block's seconds added to a metrics dict, from an injected clock."""

from __future__ import annotations

import pytest

from agentrl.timing import timed


def test_timed_adds_the_blocks_seconds_also_when_it_raises():
    ticks = iter([1.0, 3.5, 10.0, 10.25])
    metrics: dict[str, float] = {}
    with timed(metrics, "time/x_s", clock=lambda: next(ticks)):
        pass
    assert metrics == {"time/x_s": 2.5}
    with pytest.raises(RuntimeError), timed(metrics, "time/x_s", clock=lambda: next(ticks)):
        raise RuntimeError("the block failed")
    assert metrics == {"time/x_s": 2.75}  # summed, and recorded on the way out of the error
