"""SGLangEngine against SGLang's own request/response shapes (fixtures cite the SGLang and slime
files they come from), served over real HTTP by a small replay server that can also fail on
purpose: server down, 5xx, 4xx, timeout, abort."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from agentrl.engine.base import Completion, EngineError, FinishReason, SamplingParams
from agentrl.engine.sglang import SGLangEngine
from agentrl.engine.sglang.protocol import (
    ROUTING_KEY_HEADER,
    completion_from_sglang,
    num_requests_from_load,
    version_from_wire,
)
from agentrl.weights.receive import deserialize_named_tensors
from agentrl.weights.wire import flatten_bucket, serialize_for_ipc
from tests.support.servers import run_app_in_thread

FIXTURES = Path(__file__).parents[1] / "fixtures"
GENERATE = json.loads((FIXTURES / "sglang_generate.json").read_text())
CONTROL = json.loads((FIXTURES / "sglang_control.json").read_text())


class Replay:
    """A stand-in SGLang server: answers fixture responses, records what it was sent."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.generate_statuses: list[int] = []  # consumed one per /generate call, then 200
        self.generate_delay_s = 0.0
        self.response = GENERATE["responses"]["stop_token"]
        self.is_held = False
        self.release = asyncio.Event()
        self.num_running = 0
        self.version = "0.5.23"
        self.tp_size = 1
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request, body: dict = Body(...)) -> Any:
            self.requests.append(("/generate", body, dict(request.headers)))
            if self.generate_statuses:
                status = self.generate_statuses.pop(0)
                return JSONResponse(
                    {"object": "error", "message": "boom", "code": status}, status_code=status
                )
            if self.is_held:  # until abort_request, like a long generation
                self.num_running += 1
                await self.release.wait()
                self.num_running -= 1
                return GENERATE["responses"]["abort"]
            await asyncio.sleep(self.generate_delay_s)
            return self.response

        @app.post("/abort_request")
        async def abort_request(body: dict = Body(...)) -> Response:
            self.requests.append(("/abort_request", body, {}))
            self.release.set()
            return Response(status_code=200)

        @app.get("/v1/loads")
        async def loads() -> dict[str, Any]:
            return {"loads": [{"num_running_reqs": self.num_running, "num_waiting_reqs": 0}]}

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def anything(path: str, request: Request) -> Any:
            body = json.loads(await request.body() or b"{}")
            self.requests.append((f"/{path}", body, {}))
            if path == "model_info":
                return {
                    "weight_version": CONTROL["get_weight_version"]["response"]["weight_version"]
                }
            if path == "server_info":
                return {"tp_size": self.tp_size, "version": self.version}
            if path.startswith(("update_weights", "begin_weight", "end_weight")):
                return {"success": True, "message": "ok"}
            return None

        self.app = app

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [body for p, body, _ in self.requests if p == path]


@pytest.fixture
def replay():
    r = Replay()
    thread = run_app_in_thread(r.app)
    r.url = thread.url
    yield r
    thread.stop()


def _engine(url: str, **kw: Any) -> SGLangEngine:
    kw.setdefault("retry_backoff_s", 0.01)
    return SGLangEngine(url, **kw)


@pytest.mark.parametrize("name", ["stop_token", "stop_string", "length", "abort"])
def test_fixture_responses_parse_ids_and_logprobs_from_output_token_logprobs(name: str) -> None:
    out = GENERATE["responses"][name]
    c = completion_from_sglang(out)
    pairs = out["meta_info"]["output_token_logprobs"]
    assert c.ids == [p[1] for p in pairs] == out["output_ids"]
    assert c.logprobs == [p[0] for p in pairs]
    assert c.finish_reason is FinishReason(out["meta_info"]["finish_reason"]["type"])
    assert c.weight_version == version_from_wire(out["meta_info"]["weight_version"])
    assert c.matched_stop == out["meta_info"]["finish_reason"].get("matched")


def test_a_weight_version_agentrl_did_not_set_is_refused_in_one_line() -> None:
    """Policy versions are ints inside agentrl; SGLang's strings are read at its boundary."""
    assert version_from_wire("default") == 0 and version_from_wire("12") == 12
    with pytest.raises(EngineError, match="weight_version='ckpt-a' is not a policy version"):
        version_from_wire("ckpt-a")


def test_weight_versions_spans_and_the_truncation_flag_are_read() -> None:
    """SGLang's `weight_versions` (a request that crossed an update) become (version, tokens)
    spans; one span, none, or spans that miss tokens leave the completion's weight_version for
    all. `agentrl serve`'s own key says its logprobs are of the truncated distribution."""
    pairs = [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]]

    def parse(**meta: Any) -> Completion:
        meta = {"output_token_logprobs": pairs, "finish_reason": {"type": "stop"}, **meta}
        return completion_from_sglang({"meta_info": meta})

    crossed = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]
    assert parse(weight_versions=crossed).version_spans == [(3, 1), (4, 2)]
    assert parse(weight_versions=crossed[:1]).version_spans == []
    assert parse(weight_versions=crossed[1:] * 2).version_spans == []  # covers 4 of 3 tokens
    assert parse().version_spans == [] and not parse().is_logprob_truncated
    assert parse(agentrl_logprob_truncated=True).is_logprob_truncated


def test_response_without_logprobs_is_an_error_that_names_the_fix() -> None:
    with pytest.raises(EngineError, match="return_logprob"):
        completion_from_sglang({"text": "", "meta_info": {"finish_reason": {"type": "stop"}}})


def test_v1_loads_counts_running_and_waiting_requests_over_the_dp_ranks() -> None:
    ranks = [{"num_running_reqs": 2, "num_waiting_reqs": 3}, {"num_running_reqs": 1}]
    assert num_requests_from_load({"loads": ranks}) == 6
    assert num_requests_from_load({"load": 7}) == 0


async def test_generate_sends_sglangs_request_shape_and_routing_header(replay: Replay) -> None:
    engine = _engine(replay.url)
    sent = GENERATE["request"]
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=8, stop=["</answer>"], stop_token_ids=[2]
    )
    c = await engine.generate(sent["input_ids"], sampling, routing_key="episode-7")
    (path, body, headers) = replay.requests[0]
    assert body["input_ids"] == sent["input_ids"]
    assert body["sampling_params"] == sent["sampling_params"]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1
    assert headers[ROUTING_KEY_HEADER.lower()] == "episode-7"
    assert c.ids == GENERATE["responses"]["stop_token"]["output_ids"]
    assert c.served_by == replay.url  # trajectories record which server sampled each turn
    assert engine.weight_version == 0  # SGLang's "default": the weights it started with
    await engine.close()


async def test_5xx_is_retried_then_succeeds(replay: Replay) -> None:
    replay.generate_statuses = [503, 500]
    engine = _engine(replay.url, max_retries=3)
    c = await engine.generate([1, 2], SamplingParams())
    assert c.finish_reason is FinishReason.STOP
    assert len(replay.bodies("/generate")) == 3
    await engine.close()


async def test_5xx_after_all_retries_raises_engine_error(replay: Replay) -> None:
    replay.generate_statuses = [502] * 10
    engine = _engine(replay.url, max_retries=2)
    with pytest.raises(EngineError, match="after 3 attempts.*HTTP 502"):
        await engine.generate([1, 2], SamplingParams())
    assert len(replay.bodies("/generate")) == 3
    await engine.close()


async def test_4xx_is_never_retried(replay: Replay) -> None:
    replay.generate_statuses = [400]
    engine = _engine(replay.url, max_retries=3)
    with pytest.raises(EngineError, match="HTTP 400 \\(not retried\\)"):
        await engine.generate([1, 2], SamplingParams())
    assert len(replay.bodies("/generate")) == 1
    await engine.close()


async def test_timeout_raises_engine_error_naming_the_knob(replay: Replay) -> None:
    replay.generate_delay_s = 2.0
    engine = _engine(replay.url, request_timeout_s=0.2)
    with pytest.raises(EngineError, match="timed out.*request_timeout_s"):
        await engine.generate([1, 2], SamplingParams())
    await engine.close()


async def test_server_down_raises_engine_error_after_retries() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens here
    engine = _engine(f"http://127.0.0.1:{port}", max_retries=2)
    with pytest.raises(EngineError, match="after 3 attempts.*ConnectError"):
        await engine.generate([1, 2], SamplingParams())
    assert await engine.health() is False
    await engine.close()


async def test_abort_returns_abort_to_waiting_episodes_and_aborts_the_server(
    replay: Replay,
) -> None:
    replay.is_held = True
    engine = _engine(replay.url)
    episodes = [asyncio.create_task(engine.generate([1, 2], SamplingParams())) for _ in range(3)]
    while replay.num_running < 3:
        await asyncio.sleep(0.01)
    await engine.abort(poll_interval_s=0.01)
    results = await asyncio.gather(*episodes)
    assert all(c.finish_reason is FinishReason.ABORT and c.ids == [] for c in results)
    assert {"abort_all": True} in replay.bodies("/abort_request")
    # The gate is open again after the drain.
    replay.is_held = False
    assert (await engine.generate([1], SamplingParams())).finish_reason is FinishReason.STOP
    await engine.close()


async def test_a_cancelled_episode_aborts_its_own_request_on_the_server(replay: Replay) -> None:
    replay.is_held = True
    engine = _engine(replay.url)
    episode = asyncio.create_task(engine.generate([1, 2], SamplingParams()))
    while replay.num_running < 1:
        await asyncio.sleep(0.01)
    episode.cancel()
    with pytest.raises(asyncio.CancelledError):
        await episode
    while not replay.bodies("/abort_request"):
        await asyncio.sleep(0.01)
    (sent,) = replay.bodies("/generate")
    assert replay.bodies("/abort_request") == [{"rid": sent["rid"]}]
    await engine.close()


async def test_control_calls_send_sglangs_bodies(replay: Replay) -> None:
    engine = _engine(replay.url)
    await engine.release_memory()
    await engine.resume_memory()
    await engine.weights.update_weights_from_disk("/ckpt/hf", weight_version=10)
    await engine.pause_generation()
    await engine.continue_generation()
    await engine.flush_cache()
    assert replay.bodies("/release_memory_occupation") == [{"tags": None}]
    assert replay.bodies("/resume_memory_occupation") == [
        CONTROL["resume_memory_occupation_weights"]["request"],
        CONTROL["resume_memory_occupation_rest"]["request"],
    ]
    assert replay.bodies("/update_weights_from_disk") == [
        {"model_path": "/ckpt/hf", "weight_version": "10", "flush_cache": False}
    ]  # flushed after the update instead (a refused flush would fail the update)
    assert len(replay.bodies("/flush_cache")) == 2
    assert engine.weight_version == 10
    assert await engine.get_weight_version() == 0
    await engine.close()


async def test_update_weights_sends_flattened_buckets_with_version_on_the_last(
    replay: Replay,
) -> None:
    engine = _engine(replay.url)
    named = [("a", torch.ones(8)), ("b", torch.zeros(8)), ("c", torch.arange(4, dtype=torch.int64))]
    await engine.update_weights(named, weight_version=3)
    bodies = replay.bodies("/update_weights_from_tensor")
    assert len(bodies) == 2  # one flattened tensor per dtype: (a, b) and (c)
    assert all(b["load_format"] == "flattened_bucket" for b in bodies)
    assert [b.get("weight_version") for b in bodies] == [None, "3"]
    assert engine.weight_version == 3
    await engine.close()


def test_flattened_bucket_roundtrips_through_ipc_serialization() -> None:
    named = [("w", torch.randn(3, 4)), ("b", torch.randn(4))]
    payload = serialize_for_ipc(flatten_bucket(named))
    back = deserialize_named_tensors(payload, "flattened_bucket")
    assert [n for n, _ in back] == ["w", "b"]
    for (_, want), (_, got) in zip(named, back, strict=True):
        assert torch.equal(want, got) and want.shape == got.shape


def test_unpickler_refuses_code_execution_payloads() -> None:
    import base64
    import os
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    payload = base64.b64encode(pickle.dumps(Evil())).decode()
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle"):
        deserialize_named_tensors(payload, "flattened_bucket")


def test_sglang_engine_implements_the_engine_protocol() -> None:
    from agentrl.engine.base import Engine

    assert isinstance(SGLangEngine("http://127.0.0.1:30000"), Engine)


def test_constructor_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="base_url='localhost:30000'"):
        SGLangEngine("localhost:30000")


def test_collective_routes_are_never_retried_and_others_are() -> None:
    """A retried broadcast receive has no matching broadcast: both sides would block until the
    group's timeout. So a 500 on a collective route is raised at once; a 500 elsewhere is
    retried."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app, calls = FastAPI(), []

    @app.post("/{path}")
    async def failing(path: str) -> JSONResponse:
        calls.append(path)
        return JSONResponse({"error": "boom"}, status_code=500)

    thread = run_app_in_thread(app)
    engine = _engine(thread.url, max_retries=2)

    async def post(path: str) -> None:
        with pytest.raises(EngineError, match="failed after"):
            await engine.http.post(path, {})

    async def main() -> None:
        await post("/update_weights_from_distributed")
        await post("/init_weights_update_group")
        await post("/flush_cache")
        await engine.close()

    try:
        asyncio.run(main())
    finally:
        thread.stop()
    assert calls.count("update_weights_from_distributed") == 1
    assert calls.count("init_weights_update_group") == 1
    assert calls.count("flush_cache") == 3
