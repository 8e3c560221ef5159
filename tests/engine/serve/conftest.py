"""`agentrl serve` around a tiny model, on a free loopback port in a thread of this process, and
the in-process engine it is compared with. A module that needs other limits overrides
`server_limits`; one that needs more (a session opened, another client) overrides `served`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from agentrl.engine.local import LocalEngine
from agentrl.engine.serve.requests import ServerLimits
from tests.support.servers import start_server_thread


def _load(model_path: str) -> LocalEngine:
    return LocalEngine.load(model_path, device="cpu", seed=0)


@pytest.fixture(scope="module")
def local(tiny_model_path: str) -> Iterator[LocalEngine]:
    engine = _load(tiny_model_path)
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def server_limits() -> ServerLimits:
    return ServerLimits()


@pytest.fixture(scope="module")
def served(tiny_model_path: str, server_limits: ServerLimits) -> Iterator[tuple[str, LocalEngine]]:
    """One server for the module: (its URL, its engine)."""
    engine = _load(tiny_model_path)
    thread = start_server_thread(engine, limits=server_limits)
    yield thread.url, engine
    thread.stop()
    asyncio.run(engine.close())


@pytest.fixture
def fresh_served(tiny_model_path: str) -> Iterator[tuple[str, LocalEngine]]:
    """A server of its own, for tests that change its weights."""
    engine = _load(tiny_model_path)
    thread = start_server_thread(engine)
    yield thread.url, engine
    thread.stop()
    asyncio.run(engine.close())
