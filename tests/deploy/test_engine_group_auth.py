"""The engine group's servers with an API key: the key reaches each server through its
environment, never its command line (SGLang through the keyed launcher); the server refuses
calls without it; the group's clients send it; a server on another node gets a key made for
the run when none is configured (issue 38)."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from agentrl.config import EngineConfig, RunConfig
from agentrl.deploy.engines import ServedEngineGroup
from agentrl.deploy.plan import plan_deployment
from agentrl.deploy.processes import KEYED_LAUNCHER
from agentrl.deploy.servers import (
    EngineServer,
    ServerSpec,
    engine_api_key,
    server_cmd,
    server_env,
)
from agentrl.deploy.supervisor import ServerSupervisor
from agentrl.engine.base import SamplingParams
from agentrl.engine.sglang import SGLangEngine


def _spec(model_path: str, log_dir: str, **kw) -> ServerSpec:
    return ServerSpec(index=0, model_path=model_path, device_ids=[0], use_gpu=False,
                      use_sglang=False, host="127.0.0.1", dtype="float32",
                      engine=EngineConfig(max_batch_size=4, mem_fraction_static=0.5),
                      log_dir=log_dir, health_timeout_s=120, **kw)  # fmt: skip


def test_the_key_goes_to_each_kind_of_server_and_nowhere_else(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTRL_API_KEY", "inherited")
    keyed = _spec("m", str(tmp_path), api_key="k")
    assert server_env(keyed)["AGENTRL_API_KEY"] == "k"
    assert "k" not in server_cmd(keyed, 1234)  # off the command line of agentrl serve (ps)
    assert "AGENTRL_API_KEY" not in server_env(_spec("m", str(tmp_path)))
    sglang = _spec("m", str(tmp_path), api_key="k")
    sglang.use_sglang = True
    cmd = server_cmd(sglang, 1234)
    assert "k" not in cmd and "--api-key" not in cmd  # `ps` shows no key
    assert cmd[1:4] == ["-m", KEYED_LAUNCHER, "sglang.launch_server"]
    assert server_env(sglang)["AGENTRL_API_KEY"] == "k"  # where the keyed launcher reads it
    sglang.api_key = None
    assert server_cmd(sglang, 1234)[1:3] == ["-m", "sglang.launch_server"]


def test_a_server_on_another_node_gets_a_key_made_for_the_run(monkeypatch):
    monkeypatch.delenv("AGENTRL_API_KEY", raising=False)
    cfg = RunConfig()
    assert engine_api_key(cfg, ["127.0.0.1", "127.0.0.1"]) is None  # loopback only
    made = engine_api_key(cfg, ["127.0.0.1", "10.0.0.7"])
    assert made and len(made) >= 32 and made != engine_api_key(cfg, ["10.0.0.7"])  # per run
    cfg.engine.api_key = "configured"
    assert engine_api_key(cfg, ["10.0.0.7"]) == "configured"
    monkeypatch.setenv("AGENTRL_API_KEY", "from-env")
    cfg.engine.api_key = None
    assert engine_api_key(cfg, ["10.0.0.7"]) == "from-env"


async def test_the_groups_clients_send_the_servers_key(monkeypatch):
    """The key the servers were started with (a made one too), not only the config's."""
    monkeypatch.delenv("AGENTRL_API_KEY", raising=False)
    cfg = RunConfig()
    cfg.cluster.rollout_num_gpus = 2
    plan = plan_deployment(cfg, has_cuda=False)
    supervisor = ServerSupervisor([], max_restarts=0)  # started elsewhere: its URLs
    supervisor.urls = ["http://10.0.0.7:31000", "http://10.0.0.8:31000"]
    engine_cfg = dataclasses.replace(cfg.engine, api_key="made")  # as RayCluster passes it
    group = ServedEngineGroup(supervisor, engine_cfg, cfg.rollout, plan)
    try:
        assert [c.http.api_key for c in group.servers()] == ["made", "made"]
    finally:
        await group.routed.close()


@pytest.mark.slow
async def test_an_engine_server_with_a_key_refuses_calls_without_it(tiny_model_path, tmp_path):
    server = EngineServer(_spec(tiny_model_path, str(tmp_path), api_key="sekret"))
    url = server.start()
    try:
        assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200  # probes open
        assert httpx.get(f"{url}/get_model_info", timeout=30).status_code == 401
        engine = SGLangEngine(url, api_key="sekret", max_retries=0)
        assert await engine.get_weight_version() == 0
        completion = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2, seed=0))
        assert completion.ids
        await engine.release_memory()
        await engine.resume_memory()
        await engine.close()
    finally:
        server.stop()
