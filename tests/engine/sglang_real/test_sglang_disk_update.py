"""Disk weight updates through agentrl's `SGLangEngine` against SGLang's route: the checkpoint
is loaded, the version stamped, the prefix cache flushed; a bad path is an error naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agentrl.engine.base import EngineError, SamplingParams
from agentrl.engine.sglang import SGLangEngine
from tests.support.sglang_real import StandInServer, assert_loaded


async def test_update_from_disk_loads_the_checkpoint(
    sglang_server: StandInServer, tmp_path: Path
) -> None:
    named = [("disk.w", torch.arange(8, dtype=torch.float32).reshape(2, 4))]
    save_file(dict(named), str(tmp_path / "model.safetensors"))
    engine = SGLangEngine(sglang_server.url)
    prompt = [9, 8, 7]
    first = await engine.generate(prompt, SamplingParams(max_new_tokens=2))
    await engine.weights.update_weights_from_disk(str(tmp_path), weight_version=1)
    state = sglang_server.state()
    assert_loaded(state, named)
    assert state["weight_version"] == "1"
    after = await engine.generate(prompt + first.ids, SamplingParams(max_new_tokens=1))
    assert after.cached_tokens == 0 and after.weight_version == 1
    await engine.close()


async def test_a_missing_checkpoint_is_an_error_naming_it(
    sglang_server: StandInServer, tmp_path: Path
) -> None:
    engine = SGLangEngine(sglang_server.url)
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(EngineError, match="no-such-checkpoint"):
        await engine.weights.update_weights_from_disk(str(missing), weight_version=9)
    assert sglang_server.state()["weight_version"] != "9"
    await engine.close()
