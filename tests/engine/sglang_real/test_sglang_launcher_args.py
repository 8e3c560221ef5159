"""The command lines agentrl launches SGLang servers with, parsed by SGLang's own `ServerArgs`
(in a process of its own, as `python -m sglang.launch_server` would): every flag is one SGLang
knows, with the value agentrl meant; a colocated server gets the memory saver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from agentrl.config import EngineConfig
from agentrl.deploy.processes import KEYED_LAUNCHER, free_ports, server_command
from agentrl.deploy.servers import ServerSpec, server_cmd, server_env
from tests.support.sglang_real import REPO_ROOT

LAUNCH_PREFIX = ["-m", "sglang.launch_server"]


def parsed_by_sglang(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """SGLang's ServerArgs for agentrl's `python -m sglang.launch_server ARGS` command; a keyed
    one (`python -m KEYED_LAUNCHER sglang.launch_server ARGS`, the key in `env`) runs through
    the keyed launcher as it would, only the module is the harness."""
    keyed = cmd[1:4] == ["-m", KEYED_LAUNCHER, LAUNCH_PREFIX[1]]
    assert keyed or cmd[1:3] == LAUNCH_PREFIX, cmd
    launcher = ["-m", KEYED_LAUNCHER] if keyed else []
    args = cmd[4:] if keyed else cmd[3:]
    env = dict(env or os.environ, PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run(
        [sys.executable, *launcher, *(["-m"] if not keyed else []),
         "tests.engine.sglang_real.harness", "--print-server-args", *args],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def spec(model_path: str, **overrides: Any) -> ServerSpec:
    fields: dict[str, Any] = dict(
        index=1, model_path=model_path, device_ids=[2, 3], use_gpu=True, use_sglang=True,
        host="127.0.0.1", dtype="bfloat16", log_dir="/tmp", health_timeout_s=60.0,
        engine=EngineConfig(mem_fraction_static=0.55, sglang_args=["--context-length", "4096"]),
    )  # fmt: skip
    fields.update(overrides)
    return ServerSpec(**fields)


@pytest.mark.parametrize("is_colocated", [True, False])
def test_the_engine_groups_command_line(is_colocated: bool, smollm2_path: str) -> None:
    """(SGLang 0.5.15 reads the model's config while parsing: a real checkpoint.)"""
    keyed = spec(smollm2_path, is_colocated=is_colocated, api_key="k3y")
    cmd = server_cmd(keyed, 31000)
    assert "k3y" not in cmd  # off the command line (`ps`): the keyed launcher adds it inside
    args = parsed_by_sglang(cmd, server_env(keyed))
    assert args["model_path"] == smollm2_path
    assert (args["host"], args["port"]) == ("127.0.0.1", 31000)
    assert args["tp_size"] == 2 and args["base_gpu_id"] == 2
    assert args["mem_fraction_static"] == 0.55
    assert args["context_length"] == 4096
    assert args["api_key"] == "k3y"
    assert args["enable_memory_saver"] is is_colocated  # else release frees nothing


def test_the_launchers_command_line(smollm2_path: str) -> None:
    cmd = server_command(
        smollm2_path, EngineConfig(sglang_args=["--dtype", "bfloat16"]), host="127.0.0.1",
        port=30000, tp_size=1, base_gpu_id=0, enable_memory_saver=True,
    )  # fmt: skip
    args = parsed_by_sglang(cmd)
    assert (args["port"], args["tp_size"], args["base_gpu_id"]) == (30000, 1, 0)
    assert args["dtype"] == "bfloat16" and args["enable_memory_saver"] is True


def test_the_ports_agentrl_picks_are_ones_sglang_accepts(smollm2_path: str) -> None:
    """The engine group gives each server a port from `free_ports`; SGLang 0.5.15 refuses any
    --port above 55535 (it derives a gRPC port of --port + 10000, at most 65535)."""
    highest = max(free_ports(64))
    args = parsed_by_sglang(server_cmd(spec(smollm2_path), highest))
    assert args["port"] == highest
