"""`agentrl serve` speaks SGLang 0.5.23's dialect where it moved: `/server_info` and `/model_info`
(the `get_` routes are deprecated aliases, `/get_weight_version` is gone), tensor and broadcast
updates only inside `/begin_weight_update` .. `/end_weight_update`, `/update_weight_version`
aborting requests in flight unless told not to, `pause_generation {mode: retract}` sending
running requests back to go on after `continue_generation`, and `weight_versions` saying which
version sampled which output tokens."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from agentrl.engine.local import LocalEngine
from agentrl.engine.sglang.protocol import version_spans_from_sglang
from agentrl.weights.wire import flatten_bucket, serialize_for_ipc

PROMPT = [1, 9690, 198, 2683, 314]


def test_info_routes_as_in_sglang_0_5_23(fresh_served) -> None:
    url, engine = fresh_served
    with httpx.Client(base_url=url) as client:
        model = client.get("/model_info").json()
        server = client.get("/server_info").json()
        assert model["weight_version"] == str(engine.weight_version) and model["is_generation"]
        assert server["version"].startswith("agentrl-serve") and server["tp_size"] == 1
        assert server["internal_states"][0]["weight_version"] == str(engine.weight_version)
        assert client.get("/get_model_info").json() == model  # deprecated aliases
        assert client.get("/get_server_info").json()["version"] == server["version"]
        assert client.get("/get_weight_version").status_code == 404


def test_tensor_updates_only_inside_a_session(fresh_served) -> None:
    url, engine = fresh_served
    name = "model.norm.weight"
    bucket = flatten_bucket([(name, torch.full_like(engine.model.state_dict()[name], 0.5))])
    body = {"serialized_named_tensors": [serialize_for_ipc(bucket)],
            "load_format": "flattened_bucket", "weight_version": "11"}  # fmt: skip
    with httpx.Client(base_url=url, timeout=60) as client:
        outside = client.post("/update_weights_from_tensor", json=body)
        assert outside.status_code == 400 and outside.json() == {
            "success": False,
            "message": "update_weights_from_tensor must run between begin_weight_update() and "
            "end_weight_update()",
        }
        assert engine.weight_version != 11
        assert client.post("/begin_weight_update", json={}).json() == {
            "success": True, "message": "Success"}  # fmt: skip
        inside = client.post("/update_weights_from_tensor", json=body)
        assert inside.status_code == 200, inside.text
        assert client.post("/end_weight_update", json={}).status_code == 200
    assert engine.weight_version == 11
    assert torch.all(engine.model.state_dict()[name] == 0.5)


async def _started(client: httpx.AsyncClient, engine: LocalEngine, body: dict) -> asyncio.Task:
    before = engine.stats.num_generated_tokens
    task = asyncio.create_task(client.post("/generate", json=body))
    while engine.stats.num_generated_tokens == before:  # running in the engine
        await asyncio.sleep(0.005)
    return task


LONG = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200, "sampling_seed": 3}}


@pytest.mark.parametrize("abort", [None, True, False])
async def test_update_weight_version_aborts_requests_by_default(fresh_served, abort) -> None:
    url, engine = fresh_served
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        running = await _started(client, engine, LONG)
        body = {"new_version": "2"} | ({} if abort is None else {"abort_all_requests": abort})
        assert (await client.post("/update_weight_version", json=body)).json()["success"]
        out = (await running).json()
    finish = out["meta_info"]["finish_reason"]["type"]
    assert (finish == "abort") == (abort is not False), out["meta_info"]


async def test_retract_sends_running_requests_back_to_go_on_after_continue(fresh_served) -> None:
    url, engine = fresh_served
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        running = await _started(client, engine, LONG)
        assert (await client.post("/pause_generation", json={"mode": "retract"})).is_success
        loads = (await client.get("/v1/loads")).json()["loads"][0]
        assert loads["num_waiting_reqs"] == 1 and not running.done()  # held, not ended
        held = engine.stats.num_generated_tokens
        version = {"new_version": "2", "abort_all_requests": False}
        assert (await client.post("/update_weight_version", json=version)).is_success
        assert engine.stats.num_generated_tokens == held  # nothing ran while paused
        assert (await client.post("/continue_generation", json={})).is_success
        out = (await running).json()
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] != "abort" and meta["weight_version"] == "2"
    n, spans = len(out["output_ids"]), meta["weight_versions"]
    assert n == meta["completion_tokens"] > 0
    assert [s["version"] for s in spans] == ["0", "2"], spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == n
    # The client keeps which version sampled which tokens (the trajectory's per-token versions).
    k = spans[0]["end"]
    assert version_spans_from_sglang(spans, n) == [(0, k), (2, n - k)]


async def test_pause_abort_is_the_default_mode(fresh_served) -> None:
    url, engine = fresh_served
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        running = await _started(client, engine, LONG)
        assert (await client.post("/pause_generation", json={})).is_success
        out = (await running).json()
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert (await client.post("/continue_generation", json={})).is_success
        short = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        done = (await client.post("/generate", json=short)).json()["meta_info"]
    assert done["weight_versions"] == [
        {"version": "0", "start": 0, "end": done["completion_tokens"]}
    ]


async def test_a_weight_update_with_abort_all_requests_ends_requests_first(fresh_served) -> None:
    url, engine = fresh_served
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        running = await _started(client, engine, LONG)
        body = {"model_path": "/nope", "abort_all_requests": True}
        disk = await client.post("/update_weights_from_disk", json=body)
        out = (await running).json()
    assert disk.status_code == 400 and "/nope" in disk.json()["message"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
