"""Weights into `agentrl serve` over real HTTP: from tensors, from disk, by broadcast into a server
process (gloo; NCCL and CUDA IPC on GPUs); the served model then generates exactly as an
in-process one with the same weights. A resume without room is refused with its fix."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from agentrl.engine.base import EngineError, SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.engine.sglang import SGLangEngine
from tests.engine.serve.parity import PROMPTS, both, perturbed, seeded
from tests.support.servers import serve_subprocess


async def test_weight_update_from_tensor_matches_in_process_update(
    fresh_served, tiny_model_path
) -> None:
    url, _ = fresh_served
    local = LocalEngine.load(tiny_model_path, device="cpu", seed=0)
    http = SGLangEngine(url)
    named = perturbed(local, 0.5)
    await local.update_weights(named, weight_version=7)
    await http.update_weights(named, weight_version=7)
    want, got = await both(local, http, seeded(0), PROMPTS[0])
    assert got.ids == want.ids and got.logprobs == want.logprobs
    assert got.weight_version == 7 and await http.get_weight_version() == 7
    await asyncio.gather(local.close(), http.close())


async def test_weight_update_from_disk_matches_in_process_update(
    fresh_served, tiny_model_path, tmp_path
) -> None:
    url, _ = fresh_served
    local = LocalEngine.load(tiny_model_path, device="cpu", seed=0)
    await local.update_weights(perturbed(local, 0.25), weight_version=8)
    local.model.save_pretrained(tmp_path, safe_serialization=True)
    http = SGLangEngine(url)
    await http.weights.update_weights_from_disk(str(tmp_path), weight_version=8)
    want, got = await both(local, http, seeded(1), PROMPTS[1])
    assert got.ids == want.ids and got.logprobs == want.logprobs and got.weight_version == 8
    with pytest.raises(EngineError, match="no \\*.safetensors"):
        await http.weights.update_weights_from_disk(str(tmp_path / "missing"))
    await asyncio.gather(local.close(), http.close())


@pytest.mark.slow
async def test_distributed_weight_update_into_agentrl_serve_subprocess(
    tiny_model_path, tmp_path
) -> None:
    """`agentrl serve` as a real process joins a gloo group with this process (rank 0) and
    receives a broadcast update; it then generates like an in-process engine with the same weights."""
    from agentrl.weights.distributed import DistributedSender

    with serve_subprocess(tiny_model_path, tmp_path / "serve.log") as url:
        http = SGLangEngine(url)
        local = LocalEngine.load(tiny_model_path, device="cpu", seed=0)
        try:
            named = perturbed(local, 0.5)
            half = len(named) // 2
            # One bucket of one dtype goes as a flattened bucket; one of mixed dtypes (float64
            # values cast back exactly) goes tensor by tensor.
            mixed = [(n, t.double() if i % 2 else t) for i, (n, t) in enumerate(named[half:])]
            sender = DistributedSender([http.weights], backend="gloo")
            await sender.connect()
            async with httpx.AsyncClient(base_url=url) as raw:  # SGLang 0.5.23's session
                assert (await raw.post("/begin_weight_update", json={})).status_code == 200
                await sender.send(named[:half], None)
                assert await http.get_weight_version() != 1
                await sender.send(mixed, 1)
                assert (await raw.post("/end_weight_update", json={})).status_code == 200
            await sender.close()
            await local.update_weights(named, weight_version=1)
            want, got = await both(local, http, seeded(2), PROMPTS[2])
            assert got.ids == want.ids and got.logprobs == want.logprobs
            assert got.weight_version == 1 == http.weight_version
        finally:
            await asyncio.gather(local.close(), http.close())


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("path", ["tensor", "gloo", "nccl"])
async def test_gpu_weight_update_paths_into_a_cuda_server(tiny_model_path, tmp_path, path) -> None:
    """On CUDA: the tensor path sends CUDA IPC handles (what real SGLang receives); the distributed
    path broadcasts over gloo (same GPU) or NCCL (server on a second GPU, as trainer and engine
    would be). The served model then matches an in-process one with the same weights."""
    from agentrl.weights.distributed import DistributedSender

    if path == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL between two ranks needs two GPUs")
    # The server takes GPU 1 by id, seeing both GPUs as the trainer does (NCCL peer-to-peer
    # needs the same device set in both processes).
    device = "cuda:1" if path == "nccl" else "cuda"
    with serve_subprocess(tiny_model_path, tmp_path / "serve.log", device=device) as url:
        http = SGLangEngine(url)
        local = LocalEngine.load(tiny_model_path, device="cuda", seed=0)
        try:
            named = [(n, t.cuda()) for n, t in perturbed(local, 0.5)]
            if path == "tensor":
                await http.update_weights(named, weight_version=3)
            else:
                sender = DistributedSender([http.weights], backend=path)
                await sender.connect()
                async with (
                    http.weights.weight_update()
                ):  # SGLang 0.5.23: broadcasts only in a session
                    await sender.send(named, 3)
                await sender.close()
            await local.update_weights(named, weight_version=3)
            greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
            want, got = await both(local, http, greedy, PROMPTS[0])
            assert got.ids == want.ids and got.weight_version == 3
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-3)
        finally:
            await asyncio.gather(local.close(), http.close())


async def test_a_resume_without_room_is_refused_with_the_fix(fresh_served, monkeypatch) -> None:
    """The engine refuses a KV-cache resume that cannot fit (the memory saver would end the
    process); over HTTP the client raises the same error, message intact, not a bare 5xx."""
    from agentrl.engine import EngineMemoryError

    url, engine = fresh_served
    # What the check looks at; nothing runs there.
    monkeypatch.setattr(engine.memory, "device", "cuda:0")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 80 << 30))
    with pytest.raises(EngineMemoryError) as raised:
        engine.memory.require_room("kv_cache", engine.arena)
    message = str(raised.value)
    assert "the engine's kv_cache" in message and "cuda:0" in message
    assert f"engine.mem_fraction_static (now {engine.mem_fraction_static})" in message
    monkeypatch.undo()  # back on the CPU

    async def refuse(tags=None):
        raise EngineMemoryError("resuming the engine's kv_cache needs 9.00 GiB; lower it")

    monkeypatch.setattr(engine, "resume_memory", refuse)
    http = SGLangEngine(url, max_retries=0)
    await http.release_memory()
    with pytest.raises(EngineMemoryError, match="needs 9.00 GiB; lower it"):
        await http.resume_memory(["kv_cache"])
    await http.close()
