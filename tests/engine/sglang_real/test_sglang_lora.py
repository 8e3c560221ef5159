"""LoRA sync against SGLang's own code: the trainer's adapter payload (`export_adapter()` of a
real PEFT step) goes through agentrl's client to SGLang's `/load_lora_adapter_from_tensors` route
and request class, its tensor deserialization and its `LoRAConfig` / `LoRAAdapter` loading (the
stand-in keeps what SGLang loaded); a sync loads `agentrl-v{version}` and unloads the one before;
requests then name it as `lora_path`. A server started without `--enable-lora` is refused in one
line naming the flag."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from agentrl.engine.base import EngineError, SamplingParams
from agentrl.engine.sglang import SGLangEngine
from agentrl.weights.tensor import TensorSender
from tests.support.sglang_real import StandInServer

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def lora_server(standin_factory: Callable[..., StandInServer]) -> StandInServer:
    return standin_factory("--enable-lora", "--max-lora-rank", "8", "--tp-size", "2")


def _trained_adapter(model_path: str, version: int):
    from agentrl.config import AlgoConfig, TrainConfig
    from agentrl.trainer.batch import build_train_batches
    from agentrl.trainer.torch_backend import TorchBackend
    from tests.trainer.conftest import make_groups

    train = TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2)
    backend = TorchBackend(model_path, train, AlgoConfig(), device="cpu")
    backend.setup()
    groups = make_groups(num_groups=2, group_size=4, seed=version)
    backend.train_step(
        build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=0)[0]
    )
    return backend.export_adapter(dtype=torch.float32)


async def test_sglang_loads_the_trainers_adapter_and_serves_it_by_name(
    lora_server: StandInServer, tiny_model_path: str
) -> None:
    client = SGLangEngine(lora_server.url)
    sender = TensorSender([client.weights])
    first = _trained_adapter(tiny_model_path, 1)
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
    assert completion.weight_version == "1"
    await sender.send_adapter(_trained_adapter(tiny_model_path, 2), "2")
    await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
    state = lora_server.state()
    assert list(state["loras"]) == ["agentrl-v2"] and state["weight_version"] == "2"
    assert state["lora_paths_seen"][-2:] == ["agentrl-v1", "agentrl-v2"]
    await sender.send_adapter(first, "2")  # the same version again (after a heal): done
    await client.close()


async def test_a_server_without_enable_lora_is_refused_in_one_line(
    standin_factory: Callable[..., StandInServer], tiny_model_path: str
) -> None:
    server = standin_factory()
    client = SGLangEngine(server.url)
    with pytest.raises(EngineError, match="Please set `--enable-lora`") as error:
        await client.weights.load_lora_adapter(
            "agentrl-v1", _trained_adapter(tiny_model_path, 1), weight_version="1"
        )
    assert "\n" not in str(error.value)
    await client.close()
