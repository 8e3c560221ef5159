"""Release and resume of memory by tags through agentrl's `SGLangEngine` against SGLang's routes,
and what SGLang's scheduler does with them: frees only with `--enable-memory-saver`, asserts the
server is idle, and dies when asked to resume a tag it never released."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from agentrl.engine.base import SamplingParams
from agentrl.engine.sglang import SGLangEngine
from tests.support.sglang_real import StandInServer

ALL_TAGS = ["cuda_graph", "kv_cache", "weights"]


@pytest.fixture(scope="module")
def saver_server(standin_factory: Callable[..., StandInServer]) -> StandInServer:
    """A server started as agentrl's launcher starts a colocated one."""
    return standin_factory("--enable-memory-saver")


def assert_dies(server: StandInServer, path: str, body: dict) -> None:
    """The call gets no answer or a 5xx, and the server process is gone after it."""
    try:
        status = httpx.post(f"{server.url}{path}", json=body, timeout=30).status_code
    except httpx.HTTPError:
        status = None
    server.proc.wait(30)
    assert status is None or status >= 500, status
    assert not server.is_alive()


async def test_release_then_resume_by_tags(saver_server: StandInServer) -> None:
    engine = SGLangEngine(saver_server.url)
    await engine.release_memory()
    released = saver_server.state()
    await engine.resume_memory(["weights"])
    weights_back = saver_server.state()
    await engine.resume_memory(["kv_cache", "cuda_graph"])
    assert released["offload_tags"] == ALL_TAGS
    assert released["memory_saver_paused"] == ALL_TAGS  # freed: the memory saver is on
    assert weights_back["offload_tags"] == ["cuda_graph", "kv_cache"]
    assert saver_server.state()["offload_tags"] == []
    assert saver_server.is_alive()
    completion = await engine.generate([1, 2], SamplingParams(max_new_tokens=2))
    assert len(completion.ids) == 2
    await engine.close()


async def test_resume_without_release_leaves_the_server_alive(saver_server: StandInServer) -> None:
    """A colocated run resumed from a checkpoint starts with nothing released: agentrl resumes
    only what it released (SGLang would die on the rest)."""
    engine = SGLangEngine(saver_server.url)
    await engine.resume_memory()
    await engine.resume_memory(["weights"])
    assert saver_server.is_alive()
    assert (await engine.health()) is True
    await engine.close()


async def test_without_the_memory_saver_release_frees_nothing(
    sglang_server: StandInServer,
) -> None:
    engine = SGLangEngine(sglang_server.url)
    await engine.release_memory()
    state = sglang_server.state()
    await engine.resume_memory()
    assert state["offload_tags"] == ALL_TAGS and state["memory_saver_paused"] == []
    await engine.close()


async def test_sglang_dies_on_resuming_a_tag_never_released(
    standin_factory: Callable[..., StandInServer],
) -> None:
    server = standin_factory("--enable-memory-saver")
    assert_dies(server, "/resume_memory_occupation", {"tags": ["weights"]})
    assert "resumed but never released" in server.log()


async def test_sglang_dies_on_release_while_a_request_runs(
    standin_factory: Callable[..., StandInServer],
) -> None:
    server = standin_factory("--enable-memory-saver")
    engine = SGLangEngine(server.url, max_retries=0)
    server.hold(True)
    task = asyncio.ensure_future(engine.generate([3], SamplingParams(max_new_tokens=2)))
    await server.wait_until(lambda s: s["num_running"] == 1, "running")
    assert_dies(server, "/release_memory_occupation", {})
    assert "only when server is idle" in server.log()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await engine.close()
