"""The SGLang conformance suite's fixtures: SGLang's own server (tests/engine/sglang_real/harness.py)
as a process on a free loopback port, one per test module. Every test here skips, with the reason,
when `AGENTRL_SGLANG_PATH` is unset (scripts/ci_sglang.sh sets it, once per pinned version)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.sglang_real import SKIP_REASON, StandInServer, sglang_path, start_standin

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if sglang_path() is not None:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def standin_factory(
    smollm2_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., StandInServer]]:
    """Start stand-in servers (SGLang flags as arguments); all stop when the module ends."""
    servers: list[StandInServer] = []
    log_dir = tmp_path_factory.mktemp("sglang_standin")

    def start(*extra_args: str) -> StandInServer:
        server = start_standin(smollm2_path, log_dir, *extra_args)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def sglang_server(standin_factory: Callable[..., StandInServer]) -> StandInServer:
    """One stand-in SGLang server (TP 1) for the module."""
    return standin_factory()
