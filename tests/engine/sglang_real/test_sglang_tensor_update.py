"""Tensor weight updates through agentrl's `SGLangEngine` against SGLang's route and scheduler
code: flattened buckets rebuilt by SGLang's `FlattenedTensorBucket` after its safe unpickler
(`MultiprocessingSerializer`), one serialization per TP rank, inside a weight-update session
(0.5.23 refuses updates outside one), whether or not the trainer can import sglang."""

from __future__ import annotations

import base64
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from agentrl.engine.base import SamplingParams
from agentrl.engine.sglang import SGLangEngine
from tests.support.sglang_real import (
    REPO_ROOT,
    SGLANG_PATH_ENV,
    StandInServer,
    assert_loaded,
    sglang_version,
    version_tuple,
    weights,
)


def sglang_is_importable() -> bool:
    try:
        importlib.import_module("sglang.srt.weight_sync.tensor_bucket")
    except ImportError:
        return False
    return True


async def test_update_weights_loads_every_tensor_bit_exact(sglang_server: StandInServer) -> None:
    assert not sglang_is_importable()  # the trainer here cannot import SGLang
    engine = SGLangEngine(sglang_server.url)
    named = weights(1)
    await engine.update_weights(named, weight_version=1)
    state = sglang_server.state()
    assert_loaded(state, named)
    assert state["weight_version"] == "1" and state["in_session"] is False
    completion = await engine.generate([1, 2], SamplingParams(max_new_tokens=1))
    assert completion.weight_version == 1
    await engine.close()


async def test_several_buckets_in_one_session(sglang_server: StandInServer) -> None:
    engine = SGLangEngine(sglang_server.url)
    async with engine.weights.weight_update():
        await engine.update_weights(weights(2), weight_version=2)
        await engine.update_weights(weights(3), weight_version=2)
    state = sglang_server.state()
    assert_loaded(state, weights(2) + weights(3))
    assert state["weight_version"] == "2" and state["in_session"] is False
    await engine.close()


async def test_one_serialization_per_tp_rank(standin_factory: Callable[..., StandInServer]) -> None:
    server = standin_factory("--tp-size", "2")
    engine = SGLangEngine(server.url)
    named = weights(4)
    await engine.update_weights(named, weight_version=2)
    assert_loaded(server.state(), named)
    await engine.close()


HAS_SESSIONS = bool(os.environ.get(SGLANG_PATH_ENV)) and version_tuple(sglang_version()) >= (
    0,
    5,
    23,
)


@pytest.mark.skipif(not HAS_SESSIONS, reason="weight-update sessions exist from SGLang 0.5.23 on")
async def test_sglang_refuses_a_tensor_update_outside_a_session(
    sglang_server: StandInServer,
) -> None:
    payload = base64.b64encode(b"never opened").decode()
    body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket"}
    response = httpx.post(f"{sglang_server.url}/update_weights_from_tensor", json=body, timeout=30)
    assert response.status_code == 400
    assert "must run between begin_weight_update() and end_weight_update()" in response.text


TRAINER_WITH_SGLANG = """
import sys
from tests.support.sglang_real import import_sglang
import_sglang()
import torch
from agentrl.weights.wire import flatten_bucket, serialize_for_ipc
named = [("trainer.w", torch.arange(6, dtype=torch.float32).reshape(2, 3))]
bucket = flatten_bucket(named)  # kept alive until the server has copied it
print(type(bucket["metadata"][0]).__module__, flush=True)
print(serialize_for_ipc(bucket), flush=True)
sys.stdin.readline()
"""


async def test_a_trainer_that_imports_sglang_builds_a_payload_sglang_accepts(
    sglang_server: StandInServer, tmp_path: Path
) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    with open(tmp_path / "trainer.log", "w") as log:
        trainer = subprocess.Popen(
            [sys.executable, "-c", TRAINER_WITH_SGLANG],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True,
        )  # fmt: skip
    try:
        metadata_module = trainer.stdout.readline().strip()  # type: ignore[union-attr]
        payload = trainer.stdout.readline().strip()  # type: ignore[union-attr]
        assert payload, (tmp_path / "trainer.log").read_text()[-3000:]
        engine = SGLangEngine(sglang_server.url)
        async with engine.weights.weight_update():
            await engine.weights.update_weights_from_tensor([payload], weight_version=5)
        await engine.close()
    finally:
        trainer.communicate("\n", timeout=120)
    assert metadata_module.startswith("sglang.")  # SGLang's own metadata class
    state = sglang_server.state()
    assert state["weights"]["trainer.w"]["values"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert state["weight_version"] == "5"
