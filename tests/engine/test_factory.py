"""`probe_engine`: before a run loads anything, `engine.url` answers as an SGLang server, its
router or `agentrl serve` do, else one line naming the URL and what answered (issue 39)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from agentrl.config import ConfigError, EngineConfig
from agentrl.engine.factory import EngineUnreachable, probe_engine
from tests.support.servers import run_app_in_thread
from tests.support.sglang_real import free_port


def _probe(url: str) -> None:
    asyncio.run(probe_engine(EngineConfig(kind="http", url=url)))


@pytest.fixture
def serving() -> Iterator[tuple[str, dict[str, Response]]]:
    """An app whose info route answers what a test puts in the dict: not SGLang by default."""
    answers: dict[str, Response] = {"/server_info": PlainTextResponse("hello from a web server")}

    async def answer(request: Request) -> Response:
        return answers[request.url.path]

    thread = run_app_in_thread(Starlette(routes=[Route("/server_info", answer)]))
    yield thread.url, answers
    thread.stop()


def test_nothing_listening_is_one_line_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineUnreachable) as caught:
        _probe(url)
    message = str(caught.value)
    assert message.startswith(f"engine.url={url}: GET {url}/server_info: connection refused")
    assert "\n" not in message and "fix --set engine.url" in message
    assert isinstance(caught.value, ConfigError)  # the CLI's one-line user error


def test_a_404_and_a_non_sglang_answer_are_named() -> None:
    app = run_app_in_thread(Starlette(routes=[]))  # every path 404
    try:
        with pytest.raises(EngineUnreachable, match=r"/server_info answered HTTP 404"):
            _probe(app.url)
    finally:
        app.stop()


def test_a_body_that_is_no_server_info_is_named(serving) -> None:
    url, _ = serving
    with pytest.raises(EngineUnreachable, match="'hello from a web server', not an SGLang"):
        _probe(url)


def test_an_unsupported_sglang_is_refused_and_a_supported_one_passes(serving) -> None:
    url, answers = serving
    answers["/server_info"] = JSONResponse({"version": "0.4.0", "tp_size": 1})
    with pytest.raises(EngineUnreachable, match="runs SGLang 0.4.0; agentrl supports"):
        _probe(url)
    answers["/server_info"] = JSONResponse({"version": "0.5.23", "tp_size": 1})
    _probe(url)


def test_other_engine_kinds_are_not_probed() -> None:
    asyncio.run(probe_engine(EngineConfig(kind="local")))
