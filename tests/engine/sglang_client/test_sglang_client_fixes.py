"""The client against SGLang 0.5.23's rules (the stand-in of standin.py, over real HTTP): a retried
request under a fresh rid, the API key on every call, a resume only of what was released, a
flush retried while requests are queued, version stamps that abort nothing, one IPC payload per
tensor-parallel rank; and the memory metric and router choice read from SGLang's real shapes."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch

from agentrl.deploy.processes import choose_router
from agentrl.engine.base import EngineError, SamplingParams
from agentrl.engine.sglang import SGLangEngine
from agentrl.engine.sglang.protocol import memory_bytes_from_server_info
from tests.engine.sglang_client.standin import StandIn


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[StandIn]:
    standin = StandIn(**getattr(request, "param", {})).start()
    yield standin
    standin.stop()


def _engine(url: str, **kw) -> SGLangEngine:
    kw.setdefault("retry_backoff_s", 0.01)
    return SGLangEngine(url, **kw)


async def test_a_retried_generate_goes_under_a_fresh_rid(server: StandIn) -> None:
    """The first attempt may still run on the server (its answer was lost): SGLang refuses a
    second request with its rid ("Duplicate request ID")."""
    server.generate_statuses = [503]
    engine = _engine(server.url, max_retries=2)
    completion = await engine.generate([1, 2], SamplingParams(max_new_tokens=1))
    assert completion.ids == [7]
    first, second = (b["rid"] for b in server.bodies("/generate"))
    assert first != second
    await engine.close()


@pytest.mark.parametrize("server", [{"api_key": "sekret"}], indirect=True)
async def test_the_api_key_goes_with_every_call(
    server: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AGENTRL_API_KEY", raising=False)
    without = _engine(server.url, max_retries=0)
    with pytest.raises(EngineError, match="HTTP 401"):
        await without.generate([1], SamplingParams())
    await without.close()

    monkeypatch.setenv("AGENTRL_API_KEY", "sekret")  # read when no key is passed
    engine = _engine(server.url, max_retries=0)
    await engine.generate([1], SamplingParams())
    await engine.release_memory()
    await engine.resume_memory()
    await engine.update_weights([("w", torch.ones(2))], weight_version=1)
    await engine.abort(poll_interval_s=0.01, max_wait_s=0.1)
    assert await engine.health()
    sent = [(p, h.get("authorization")) for p, _, h in server.requests if p != "/v1/loads"]
    assert all(auth == "Bearer sekret" for _, auth in sent), sent
    await engine.close()


async def test_a_resume_never_sends_a_tag_that_was_not_released(server: StandIn) -> None:
    """After a colocated --resume nothing was released: resuming anyway kills a real server."""
    engine = _engine(server.url)
    await engine.resume_memory(["weights"])
    await engine.resume_memory(["kv_cache", "cuda_graph"])
    assert server.bodies("/resume_memory_occupation") == [] and not server.is_dead

    await engine.release_memory(["kv_cache"])
    await engine.resume_memory()  # weights (never released), then kv_cache + cuda_graph
    assert server.bodies("/resume_memory_occupation") == [{"tags": ["kv_cache"]}]
    assert not server.is_dead and engine.released_tags() == set()
    await engine.close()


async def test_a_flush_refused_while_requests_are_queued_is_retried(server: StandIn) -> None:
    server.num_flush_refusals = 2
    engine = _engine(server.url)
    await engine.flush_cache()
    assert server.paths().count("/flush_cache") == 3
    server.num_flush_refusals = 1000
    with pytest.raises(EngineError, match="flush_cache still refused after 0.3s"):
        await engine.flush_cache(max_wait_s=0.3, poll_interval_s=0.05)
    await engine.close()


async def test_a_version_stamp_without_weights_aborts_nothing(server: StandIn) -> None:
    engine = _engine(server.url)
    await engine.update_weights([], weight_version=5)
    assert server.bodies("/update_weight_version") == [
        {"new_version": "5", "abort_all_requests": False}  # SGLang's default aborts them all
    ]
    assert engine.weight_version == 5
    await engine.close()


@pytest.mark.parametrize("server", [{"tp_size": 2}], indirect=True)
async def test_each_tensor_parallel_rank_gets_its_own_serialization(
    server: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each serialization of a CUDA tensor takes one reference on the sender's side and each
    rank drops one when done: one payload copied to every rank drops it TP times (SGLang's
    deserialize_own_rank). On CPU the payloads' bytes are equal, so the serializations are
    counted."""
    from agentrl.engine.sglang import weights as sglang_weights

    calls = []
    real = sglang_weights.serialize_for_ipc
    monkeypatch.setattr(
        sglang_weights, "serialize_for_ipc", lambda obj: calls.append(obj) or real(obj)
    )
    engine = _engine(server.url)
    await engine.update_weights([("w", torch.ones(3)), ("i", torch.ones(2, dtype=torch.int64))],
                                weight_version=1)  # fmt: skip
    bodies = server.bodies("/update_weights_from_tensor")
    assert [len(b["serialized_named_tensors"]) for b in bodies] == [2, 2]  # two dtypes
    assert len(calls) == 4 and calls[0] is calls[1] and calls[2] is calls[3]
    await engine.close()


def test_the_memory_metric_reads_what_sglang_reports() -> None:
    """SGLang's internal state has `memory_usage` (GB, sized at start), never the
    `memory_allocated_bytes` agentrl serve reports: the metric was always 0 against it."""
    info = {"internal_states": [{"memory_usage": {"weight": 1.5, "kvcache": 6.0,
                                                  "graph": {"decode": 0.5}}}]}  # fmt: skip
    assert memory_bytes_from_server_info(info) == pytest.approx(8.0e9)
    assert memory_bytes_from_server_info(info, {"weights", "kv_cache", "cuda_graph"}) == 0
    assert memory_bytes_from_server_info(info, {"weights"}) == pytest.approx(6.5e9)
    ours = {"internal_states": [{"memory_allocated_bytes": 123}]}
    assert memory_bytes_from_server_info(ours) == 123


def test_the_router_is_smg_with_consistent_hashing_else_sglang_router_with_manual(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    installed = {"smg": True, "sglang_router": True}

    def find_spec(name: str, *args):
        if name in installed:
            return object() if installed[name] else None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    choice = choose_router("consistent_hashing")
    assert (choice.module, choice.policy) == ("smg", "consistent_hashing")
    installed["smg"] = False  # sglang-router 0.3.2's CLI refuses consistent_hashing
    choice = choose_router("consistent_hashing")
    assert (choice.module, choice.policy) == ("sglang_router", "manual")
