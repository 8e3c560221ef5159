"""LoRA sync against SGLang's own code: the trainer's adapter payload (`export_adapter()` of a
real PEFT step) goes through agentrl's client to SGLang's `/load_lora_adapter_from_tensors` route
and request class, its tensor deserialization and its `LoRAConfig` / `LoRAAdapter` loading (the
stand-in keeps what SGLang loaded); a sync loads `agentrl-v{version}` and unloads the one before;
requests then name it as `lora_path`. A server started without `--enable-lora` is refused in one
line naming the flag."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from agentrl.engine.base import EngineError, SamplingParams
from agentrl.engine.sglang import SGLangEngine
from agentrl.weights.adapter import AdapterExport
from agentrl.weights.tensor import TensorSender
from tests.support.sglang_real import REPO_ROOT, StandInServer

if importlib.util.find_spec("peft") is None:  # the trainer's process needs it; this one must not
    pytest.skip("LoRA needs peft: pip install 'agentrl[lora]'", allow_module_level=True)


@pytest.fixture(scope="module")
def lora_server(standin_factory: Callable[..., StandInServer]) -> StandInServer:
    return standin_factory("--enable-lora", "--max-lora-rank", "8", "--tp-size", "2")


TRAIN_AND_EXPORT = """
import sys
from pathlib import Path
from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainer.batch import build_train_batches
from agentrl.trainer.lora import save_adapter
from agentrl.trainer.torch_backend import TorchBackend
from tests.support.models import make_tiny_model
from tests.trainer.conftest import make_groups

tokenizer_path, out = sys.argv[1], Path(sys.argv[2])
model_path = make_tiny_model(str(out / "model"), tokenizer_path, num_layers=2, hidden_size=64)
backend = TorchBackend(model_path, TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2), AlgoConfig(),
                       device="cpu")
backend.setup()
for version in (1, 2):
    groups = make_groups(num_groups=2, group_size=4, seed=version)
    batch = build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=0)[0]
    backend.train_step(batch)
    (out / str(version)).mkdir()
    save_adapter(out / str(version), backend.export_adapter())
"""


@pytest.fixture(scope="module")
def trained_adapters(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model's adapter after steps 1 and 2, exported and saved by the trainer in a process
    of its own: transformers' filled config registry (the tiny model's, PEFT's) makes SGLang's
    own registrations fail in any process that imports it later."""
    out = tmp_path_factory.mktemp("adapters")
    cmd = [sys.executable, "-c", TRAIN_AND_EXPORT, smollm2_path, str(out)]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, capture_output=True, timeout=600)
    return out


def _trained_adapter(adapters: Path, version: int) -> AdapterExport:
    from safetensors.torch import load_file

    saved = adapters / str(version)
    config = json.loads((saved / "adapter_config.json").read_text())
    return AdapterExport(list(load_file(str(saved / "adapter_model.safetensors")).items()), config)


async def test_sglang_loads_the_trainers_adapter_and_serves_it_by_name(
    lora_server: StandInServer, trained_adapters: Path
) -> None:
    client = SGLangEngine(lora_server.url)
    sender = TensorSender([client.weights])
    first = _trained_adapter(trained_adapters, 1)
    await sender.send_adapter(first, "1")
    state = lora_server.state()
    assert list(state["loras"]) == ["agentrl-v1"] and state["weight_version"] == "1"
    loaded = state["loras"]["agentrl-v1"]
    assert loaded["scaling"] == 2.0  # alpha / r, read by SGLang's LoRAConfig
    # SGLang stacked PEFT's q/k/v A matrices into its qkv_proj (rows of q, then k, then v)
    a = dict(first.named_tensors)
    layer0 = "base_model.model.model.layers.0"
    want_qkv = torch.cat([a[f"{layer0}.self_attn.{p}_proj.lora_A.weight"] for p in "qkv"])
    assert (
        loaded["weights"][f"{layer0}.self_attn.qkv_proj.lora_A.weight"]
        == want_qkv.flatten().tolist()
    )
    assert (
        len(loaded["shapes"]) == len(first.named_tensors) - 2 * 2 * 3
    )  # 2 layers: qkv, gate_up fused

    completion = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
    assert completion.weight_version == 1
    await sender.send_adapter(_trained_adapter(trained_adapters, 2), "2")
    await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
    state = lora_server.state()
    assert list(state["loras"]) == ["agentrl-v2"] and state["weight_version"] == "2"
    assert state["lora_paths_seen"][-2:] == ["agentrl-v1", "agentrl-v2"]
    await sender.send_adapter(first, "2")  # the same version again (after a heal): done
    await client.close()


async def test_a_server_without_enable_lora_is_refused_in_one_line(
    standin_factory: Callable[..., StandInServer], trained_adapters: Path
) -> None:
    server = standin_factory()
    client = SGLangEngine(server.url)
    with pytest.raises(EngineError, match="Please set `--enable-lora`") as error:
        await client.weights.load_lora_adapter(
            "agentrl-v1", _trained_adapter(trained_adapters, 1), weight_version=1
        )
    assert "\n" not in str(error.value)
    await client.close()
