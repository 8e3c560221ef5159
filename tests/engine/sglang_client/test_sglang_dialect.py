"""Version negotiation: `SGLangEngine` reads each server's version once and speaks its dialect
(routes, weight-update sessions), and refuses a release outside the supported window in one
line. Against the stand-in of tests/engine/sglang_client/standin.py over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from agentrl.engine.base import EngineError
from agentrl.engine.sglang import SGLangEngine
from agentrl.engine.sglang.dialect import SUPPORTED_RANGE
from tests.engine.sglang_client.standin import StandIn

BUCKET = [("w", torch.ones(4)), ("b", torch.zeros(2))]


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[StandIn]:
    standin = StandIn(**getattr(request, "param", {})).start()
    yield standin
    standin.stop()


def _engine(url: str) -> SGLangEngine:
    return SGLangEngine(url, retry_backoff_s=0.01, max_retries=0)


@pytest.mark.parametrize("server", [{"version": "0.4.6"}, {"version": "0.6.1"}], indirect=True)
async def test_a_release_outside_the_window_is_refused_in_one_line(server: StandIn) -> None:
    engine = _engine(server.url)
    with pytest.raises(EngineError) as error:
        await engine.get_weight_version()
    message = str(error.value)
    assert f"SGLang {server.version}" in message and SUPPORTED_RANGE in message
    assert "\n" not in message
    assert server.paths() == ["/server_info"]  # nothing else is sent to it
    await engine.close()


async def test_the_version_is_read_once_and_the_weight_version_from_model_info(
    server: StandIn,
) -> None:
    """0.5.23 has no /get_weight_version (404) and only deprecated aliases of the info routes."""
    engine = _engine(server.url)
    assert await engine.get_weight_version() == 0
    await engine.get_server_info()
    await engine.get_weight_version()
    assert server.paths().count("/server_info") == 2  # the dialect read + one info call
    assert "/get_weight_version" not in server.paths()
    assert "/get_server_info" not in server.paths() and "/get_model_info" not in server.paths()
    await engine.close()


async def test_tensor_updates_run_in_a_session_and_the_cache_is_flushed_after(
    server: StandIn,
) -> None:
    engine = _engine(server.url)
    await engine.update_weights(BUCKET, weight_version=1)
    update_paths = [p for p in server.paths() if not p.endswith("_info")]
    assert update_paths == [
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/end_weight_update",
        "/flush_cache",
    ]
    (body,) = server.bodies("/update_weights_from_tensor")
    assert body["flush_cache"] is False and body["abort_all_requests"] is False
    assert body["weight_version"] == "1" and server.weight_version == "1"
    assert not server.is_session_open
    await engine.close()


async def test_one_session_spans_the_buckets_of_a_sync(server: StandIn) -> None:
    engine = _engine(server.url)
    async with engine.weights.weight_update():
        await engine.update_weights(BUCKET, weight_version=0)
        await engine.update_weights(BUCKET, weight_version=2)
    assert server.paths().count("/begin_weight_update") == 1
    assert server.paths().count("/end_weight_update") == 1
    paths = server.paths()
    assert paths.count("/update_weights_from_tensor") == 2
    # one flush per update, once every bucket is in (beside the session's end, not after it)
    assert paths.count("/flush_cache") == 1
    assert paths.index("/flush_cache") > len(paths) - 1 - paths[::-1].index(
        "/update_weights_from_tensor"
    )
    await engine.close()


async def test_a_session_left_open_by_a_dead_trainer_is_closed_and_reopened(
    server: StandIn,
) -> None:
    server.is_session_open = True
    engine = _engine(server.url)
    await engine.update_weights(BUCKET, weight_version=1)
    assert server.weight_version == "1" and not server.is_session_open
    await engine.close()


@pytest.mark.parametrize(
    "server", [{"version": "0.5.15.post1", "has_sessions": False}], indirect=True
)
async def test_a_release_without_sessions_is_asked_once_then_updated_directly(
    server: StandIn,
) -> None:
    engine = _engine(server.url)
    await engine.update_weights(BUCKET, weight_version=1)
    await engine.update_weights(BUCKET, weight_version=2)
    assert server.paths().count("/begin_weight_update") == 1  # 404 once, remembered
    assert "/end_weight_update" not in server.paths()
    assert server.weight_version == "2"
    await engine.close()


@pytest.mark.parametrize(
    "server", [{"version": "agentrl-serve/0.1", "has_sessions": False}], indirect=True
)
async def test_agentrl_serve_is_known_by_its_version(server: StandIn) -> None:
    engine = _engine(server.url)
    assert await engine.get_weight_version() == 0
    assert (await engine.dialect()).is_agentrl_serve
    assert server.paths() == ["/server_info", "/model_info"]
    await engine.update_weights(BUCKET, weight_version=3)
    assert server.weight_version == "3"
    await engine.close()
