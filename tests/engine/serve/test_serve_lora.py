"""LoRA through `agentrl serve` over real HTTP (CPU): a trainer rank's adapter-only sync loads the
adapter with SGLang 0.5.23's `/load_lora_adapter_from_tensors` and unloads the one before with
`/unload_lora_adapter` (admin routes, keyed); the client's requests name it as `lora_path`, and
the served logprobs equal teacher-forced transformers on the merged model."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from agentrl.engine.base import EngineError, SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.engine.sglang import SGLangEngine
from tests.support.servers import start_server_thread
from tests.trainer.test_lora import _batch, _teacher_forced, _worker, backend_of

pytest.importorskip("peft")

KEY = "lora-test-key"


@pytest.mark.slow
def test_a_lora_step_served_through_agentrl_serve_is_exact(tiny_model_path, tmp_path) -> None:
    from agentrl.config import AlgoConfig

    engine = LocalEngine.load(tiny_model_path, device="cpu", seed=0)
    server = start_server_thread(engine, api_key=KEY)
    client = SGLangEngine(server.url, api_key=KEY)
    worker = _worker(tiny_model_path)
    worker.connect_engines([client], "tensor")  # in process, the rollouts' own client
    prompt = list(range(5, 17))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)
    try:
        for step, version in enumerate([1, 2]):
            worker.train_step(_batch(AlgoConfig(), seed=9 + step))
            sent = worker.send_weights(version)
            assert sent["bytes"] == worker.backend.adapter_size_bytes()
            assert client.lora_name == f"agentrl-v{version}"
            completion = asyncio.run(client.generate(prompt, sampling))
            assert completion.weight_version == version
            backend_of(worker).export_merged(tmp_path / f"v{version}")
            sequence = prompt + completion.ids
            want = _teacher_forced(str(tmp_path / f"v{version}"), sequence, len(prompt))
            assert completion.logprobs == pytest.approx(want, abs=1e-5, rel=0)
        untrained = _teacher_forced(tiny_model_path, sequence, len(prompt))
        assert max(abs(a - b) for a, b in zip(want, untrained, strict=True)) > 1e-3
        _check_routes(server.url, client)
    finally:
        worker.shutdown()
        server.stop()
        asyncio.run(engine.close())


def _check_routes(url: str, client: SGLangEngine) -> None:
    """SGLang's answers: the adapter before was unloaded; a request naming it is a 400; the
    routes want the key; an adapter named twice is refused."""
    auth = {"Authorization": f"Bearer {KEY}"}
    unload = httpx.post(
        f"{url}/unload_lora_adapter", json={"lora_name": "agentrl-v1"}, headers=auth
    )
    assert unload.status_code == 400 and unload.json()["success"] is False
    assert "not loaded" in unload.json()["error_message"]
    body = {
        "input_ids": [5, 6, 7],
        "lora_path": "agentrl-v1",
        "sampling_params": {"max_new_tokens": 2},
    }
    stale = httpx.post(f"{url}/generate", json=body, headers=auth)
    assert stale.status_code == 400 and "lora_path='agentrl-v1'" in stale.text
    keyless = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "agentrl-v2"})
    assert keyless.status_code == 401
    with pytest.raises(EngineError, match="already loaded|HTTP 400"):
        asyncio.run(
            client.weights.http.post(
                "/load_lora_adapter_from_tensors",
                {
                    "lora_name": "agentrl-v2",
                    "config_dict": {"r": 4, "lora_alpha": 8},
                    "serialized_named_tensors": ["x"],
                },
            )
        )
    done = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "agentrl-v2"}, headers=auth)
    assert done.status_code == 200 and done.json()["loaded_adapters"] == {}
