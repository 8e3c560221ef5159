"""The command lines of a server and a router (SGLang's and the routers' flag names; the key
never on them) and the free ports they listen on."""

from __future__ import annotations

import sys

from agentrl.config import EngineConfig
from agentrl.deploy.processes import (
    MAX_SERVER_PORT,
    MIN_SERVER_PORT,
    free_ports,
    router_command,
    server_command,
)


def test_commands_use_sglang_and_router_flag_names() -> None:
    cmd = server_command(
        "/m",
        EngineConfig(mem_fraction_static=0.7, sglang_args=["--context-length", "8192"]),
        host="127.0.0.1",
        port=30001,
        tp_size=2,
        base_gpu_id=2,
    )
    assert cmd == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--tp-size",
        "2",
        "--mem-fraction-static",
        "0.7",
        "--base-gpu-id",
        "2",
        "--context-length",
        "8192",
    ]
    router = router_command(
        ["http://a:1", "http://b:2"],
        host="127.0.0.1",
        port=30000,
        policy="consistent_hashing",
    )
    assert router[:-1] == [
        sys.executable,
        "-m",
        "smg.launch_router",
        "--worker-urls",
        "http://a:1",
        "http://b:2",
        "--policy",
        "consistent_hashing",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "--prometheus-host",  # the routers' default is 0.0.0.0:29000: every interface
        "127.0.0.1",
        "--prometheus-port",
    ]
    assert int(router[-1]) != 29000  # a free port of its own


def test_a_key_stays_off_the_command_lines() -> None:
    """Issue 38: `ps` shows every local user a command line (test_supervisor.py shows the key
    reaching SGLang's argv inside the process)."""
    cmd = server_command("/m", EngineConfig(), host="127.0.0.1", port=1, tp_size=1, api_key="k3y")
    assert "k3y" not in cmd and "--api-key" not in cmd
    router = router_command(["http://a:1"], host="127.0.0.1", port=1, policy="p", api_key="k3y")
    assert "k3y" not in router and "--api-key" not in router


def test_free_ports_are_distinct_and_ones_sglang_accepts() -> None:
    """SGLang 0.5.15 refuses a --port whose gRPC twin (port + 10000) passes 65535; the ephemeral
    range reaches 60999, so free ports are drawn at or below MAX_SERVER_PORT."""
    ports = free_ports(64)
    assert len(set(ports)) == 64
    assert max(ports) <= MAX_SERVER_PORT and MAX_SERVER_PORT + 10000 <= 65535
    assert min(ports) >= MIN_SERVER_PORT >= 20000  # Ray's worker ports are 10002-19999
