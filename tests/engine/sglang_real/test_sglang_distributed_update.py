"""Broadcast weight updates: the run's `DistributedSender` (trainer rank 0) and SGLang's
receiver in one gloo group made by SGLang's `init_custom_process_group`, the bucket received as
SGLang receives it (`FlattenedTensorBucket`), inside a session, the prefix cache flushed after."""

from __future__ import annotations

import torch

from agentrl.engine.base import SamplingParams
from agentrl.engine.sglang import SGLangEngine
from agentrl.weights import make_sender
from tests.support.sglang_real import StandInServer, assert_loaded, weights


async def test_broadcast_buckets_arrive_bit_exact_and_the_cache_is_flushed(
    sglang_server: StandInServer,
) -> None:
    engine = SGLangEngine(sglang_server.url)
    prompt = [2, 4, 6, 8]
    first = await engine.generate(prompt, SamplingParams(max_new_tokens=2))
    warm = await engine.generate(prompt + first.ids, SamplingParams(max_new_tokens=1))
    assert warm.cached_tokens > 0  # the prefix cache holds KV of the old weights
    mixed = weights(7)  # float32 and bfloat16: one flat bucket per dtype
    one_dtype = [("layers.8.w", torch.linspace(-1, 1, 12).reshape(3, 4))]
    sender = await make_sender(
        "distributed", [engine.weights], model_path="", master_address="127.0.0.1"
    )
    await sender.begin()
    await sender.send(mixed, None)
    await sender.send(one_dtype, 6)  # the version comes with the last bucket
    await sender.end(6)
    await sender.close()
    state = sglang_server.state()
    assert_loaded(state, mixed + one_dtype)
    assert state["weight_version"] == "6" and state["in_session"] is False
    after = await engine.generate(prompt + first.ids, SamplingParams(max_new_tokens=1))
    assert after.cached_tokens == 0  # no reuse of KV computed with the old weights
    assert after.weight_version == 6
    await engine.close()
    assert sglang_server.state()["groups"] == []  # both sides left the group
