"""One end-to-end episode group on the real LocalEngine (tiny random model, SmolLM2 tokenizer)."""

from __future__ import annotations

import math

import pytest

from agentrl.config import RolloutConfig
from agentrl.envs import make
from agentrl.rollout.group import RolloutRunner
from agentrl.types import EpisodeStatus, Task


@pytest.mark.slow
async def test_calculator_group_on_the_local_engine(tiny_model_path: str) -> None:
    from agentrl.engine.local import LocalEngine

    engine = LocalEngine.load(
        tiny_model_path, device="cpu", dtype="float32", max_batch_size=4, seed=0
    )
    sampled: list[list[int]] = []
    generate = engine.generate

    async def recording_generate(input_ids, sampling, **kw):  # type: ignore[no-untyped-def]
        completion = await generate(input_ids, sampling, **kw)
        sampled.append(completion.ids)
        return completion

    engine.generate = recording_generate  # type: ignore[method-assign]
    cfg = RolloutConfig(max_turns=2, rollout_max_response_len=12, rollout_max_context_len=1024)
    try:
        runner = RolloutRunner(engine, lambda: make("calculator"), cfg, tokenizer=engine.tokenizer)
        group = await runner.run_group(Task("c0", {"question": "What is 2 + 3?", "answer": 5}), 2)
    finally:
        await engine.close()

    assert {t.status for t in group} <= {EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED}
    spans = [
        t.token_ids[turn.start : turn.start + turn.num_sampled] for t in group for turn in t.turns
    ]
    assert sorted(spans) == sorted(sampled)
    for traj in group:
        traj.check()
        assert len(traj.logprobs) == sum(traj.loss_mask) > 0
        assert all(math.isfinite(lp) and lp <= 0 for lp in traj.logprobs)
        assert traj.turns[0].weight_version == engine.weight_version
