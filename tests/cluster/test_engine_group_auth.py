"""The engine group's servers with an API key: the key reaches `agentrl serve` through its
environment (SGLang on its command line), the server refuses calls without it, and the group's
clients send it."""

from __future__ import annotations

import httpx
import pytest

from agentrl.cluster.engine_group import EngineServer, ServerSpec, server_cmd, server_env
from agentrl.config import EngineConfig
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
    assert cmd[cmd.index("--api-key") + 1] == "k"


@pytest.mark.slow
async def test_an_engine_server_with_a_key_refuses_calls_without_it(tiny_model_path, tmp_path):
    server = EngineServer(_spec(tiny_model_path, str(tmp_path), api_key="sekret"))
    url = server.start()
    try:
        assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200  # probes open
        assert httpx.get(f"{url}/get_model_info", timeout=30).status_code == 401
        engine = SGLangEngine(url, api_key="sekret", max_retries=0)
        assert await engine.get_weight_version() == "0"
        completion = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2, seed=0))
        assert completion.ids
        await engine.release_memory()
        await engine.resume_memory()
        await engine.close()
    finally:
        server.stop()
