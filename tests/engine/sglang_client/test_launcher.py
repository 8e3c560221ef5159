"""The SGLang launcher against a stand-in `sglang` package (tests/engine/fixtures/fake_sglang)
whose `sglang.launch_server` starts agentrl's own server: flags and passthrough arguments,
health wait, a dead server reported with its last log lines, restarts, shutdown."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

from agentrl.config import EngineConfig
from agentrl.engine.base import EngineError, SamplingParams
from agentrl.engine.sglang import SGLangEngine
from agentrl.engine.sglang.launcher import (
    ManagedProcess,
    SGLangCluster,
    SGLangNotInstalled,
    free_ports,
    launch_servers,
    router_command,
    server_command,
)

FAKE_SGLANG = Path(__file__).parents[1] / "fixtures" / "fake_sglang"
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    monkeypatch.syspath_prepend(str(FAKE_SGLANG))
    path = os.pathsep.join(
        p for p in (str(FAKE_SGLANG), str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    return {**os.environ, "PYTHONPATH": path, "FAKE_SGLANG_ARGV_DIR": str(tmp_path)}


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(kind="sglang", port=0, mem_fraction_static=0.5, **kw)


def test_missing_sglang_extra_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a)
    )
    with pytest.raises(
        SGLangNotInstalled, match=r"pip install 'agentrl\[sglang\]'.*engine.kind=http"
    ):
        launch_servers("/models/x", _cfg())


def test_several_servers_need_sglang_router(fake_sglang: dict[str, str]) -> None:
    if importlib.util.find_spec("sglang_router") is not None:
        pytest.skip("sglang_router is installed here")
    with pytest.raises(SGLangNotInstalled, match="sglang_router"):
        launch_servers("/models/x", _cfg(num_servers=2), env=fake_sglang)


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


def test_server_that_dies_at_startup_fails_the_launch_with_its_log(
    fake_sglang: dict[str, str],
) -> None:
    env = {**fake_sglang, "FAKE_SGLANG_FAIL_AT_START": "1"}
    with pytest.raises(
        EngineError, match="(?s)failed to start.*exited with code 1.*Not enough memory"
    ):
        launch_servers("/models/x", _cfg(), env=env, health_timeout_s=60)


def test_a_servers_key_reaches_sglangs_argv_but_not_its_command_line(
    fake_sglang: dict[str, str], tmp_path: Path
) -> None:
    """Issue 38: `ps` shows every local user a command line; the key goes in the environment,
    and the keyed launcher adds `--api-key` inside the process (SGLang reads no variable)."""
    cmd = server_command("/models/x", _cfg(), host="127.0.0.1", port=30001, tp_size=1,
                         api_key="k3y")  # fmt: skip
    assert "k3y" not in cmd and "--api-key" not in cmd
    router = router_command(["http://a:1"], host="127.0.0.1", port=1, policy="p", api_key="k3y")
    assert "k3y" not in router and "--api-key" not in router
    env = {**fake_sglang, "FAKE_SGLANG_FAIL_AT_START": "1"}  # records its argv, then exits
    with pytest.raises(EngineError, match="failed to start"):
        launch_servers("/models/x", _cfg(), env=env, health_timeout_s=60, api_key="k3y")
    (argv,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert argv[-2:] == ["--api-key", "k3y"] and argv[:2] == ["--model-path", "/models/x"]


CRASH_ONCE = """
import http.server, pathlib, sys
marker, port = pathlib.Path(sys.argv[1]), int(sys.argv[2])
if not marker.exists():  # the first start dies as a GPU server does; the restart serves
    marker.touch()
    print("torch.OutOfMemoryError: CUDA out of memory", flush=True)
    raise SystemExit(3)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _crashing_cluster(tmp_path: Path, max_restarts: int) -> SGLangCluster:
    import sys

    tmp_path.mkdir(exist_ok=True)
    (port,) = free_ports(1)
    cmd = [sys.executable, "-c", CRASH_ONCE, str(tmp_path / "crashed"), str(port)]
    process = ManagedProcess("sglang-server-0", f"http://127.0.0.1:{port}", cmd, tmp_path / "s.log")
    process.start()
    assert process.proc is not None
    process.proc.wait(timeout=30)  # it crashed
    return SGLangCluster(process.url, [process], max_restarts=max_restarts, health_timeout_s=60)


async def test_a_dead_server_past_its_restarts_stops_the_run_with_its_log(tmp_path: Path) -> None:
    cluster = _crashing_cluster(tmp_path, max_restarts=0)
    try:
        report = cluster.failure_report()  # what a client's connection error quotes
        assert report is not None and "exited with code 3" in report
        assert "CUDA out of memory" in report
        with pytest.raises(RuntimeError, match="(?s)engine 0 .*limit 0.*CUDA out of memory"):
            await cluster.heal()
        assert cluster.num_restarts == [0] and not cluster.servers[0].is_alive()
    finally:
        cluster.shutdown()


async def test_heal_restarts_a_dead_server_and_reports_it_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = _crashing_cluster(tmp_path, max_restarts=1)
    try:
        with caplog.at_level("WARNING", logger="agentrl.engine.sglang.supervisor"):
            assert await cluster.heal() == [0]
            assert await cluster.heal() == []  # alive again: nothing to do, nothing reported
        (record,) = caplog.records
        assert "restarting (1/1)" in record.message and "CUDA out of memory" in record.message
        assert cluster.servers[0].is_alive() and cluster.failure_report() is None
        assert cluster.num_restarts == [1]
    finally:
        cluster.shutdown()
    assert not cluster.servers[0].is_alive()


async def test_heal_restarts_a_dead_router_on_its_port(tmp_path: Path) -> None:
    """The router is supervised too: restarted where it was, the servers left alone."""
    server = _crashing_cluster(tmp_path / "s", max_restarts=1)  # its restart will serve
    router = _crashing_cluster(tmp_path / "r", max_restarts=1).servers[0]
    assert await server.heal() == [0]
    cluster = SGLangCluster(router.url, server.servers, router=router, max_restarts=1,
                            health_timeout_s=60)  # fmt: skip
    try:
        assert cluster.failure_report() is not None  # the router's exit, with its log
        assert await cluster.heal() == []  # no server died
        assert router.is_alive() and cluster.failure_report() is None
        assert cluster.num_restarts == [0]
    finally:
        cluster.shutdown()


@pytest.mark.slow
async def test_make_engine_launches_generates_reports_a_crash_restarts_and_shuts_down(
    fake_sglang: dict[str, str],
    tiny_model_path: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agentrl.config import RunConfig
    from agentrl.engine.factory import make_engine

    trigger = tmp_path / "crash-now"
    for key in ("PYTHONPATH", "FAKE_SGLANG_ARGV_DIR"):
        monkeypatch.setenv(key, fake_sglang[key])
    monkeypatch.setenv("FAKE_SGLANG_CRASH_TRIGGER", str(trigger))
    cfg = RunConfig()
    cfg.model.path = tiny_model_path
    cfg.engine = _cfg(
        sglang_args=["--context-length", "512"], restart_on_failure=True, max_retries=0
    )
    engine = make_engine(
        cfg
    )  # kind=sglang: launch_servers(path, cfg.engine), then SGLangEngine(cluster.url)
    assert isinstance(engine, SGLangEngine)
    cluster = engine.http.cluster
    try:
        completion = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, seed=0))
        assert len(completion.ids) == len(completion.logprobs) > 0
        (argv,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
        assert argv[argv.index("--model-path") + 1] == tiny_model_path
        assert argv[argv.index("--mem-fraction-static") + 1] == "0.5"
        assert argv[-2:] == ["--context-length", "512"]

        trigger.touch()
        deadline = time.monotonic() + 60
        while cluster.failure_report() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        report = cluster.failure_report()
        assert (
            report is not None
            and "exited with code 3" in report
            and "simulated CUDA error" in report
        )
        with pytest.raises(EngineError, match="simulated CUDA error"):
            await engine.generate([1, 2], SamplingParams(max_new_tokens=2))
        assert await engine.heal() == [0]  # what the run's EngineGroup.heal calls
        await engine.wait_healthy(timeout_s=120, interval_s=0.2)
        assert cluster.num_restarts == [1]
        assert (await engine.generate([1, 2], SamplingParams(max_new_tokens=2, seed=0))).ids
    finally:
        await engine.close()
    assert not cluster.servers[0].is_alive()


def test_free_ports_are_distinct_and_ones_sglang_accepts() -> None:
    """SGLang 0.5.15 refuses a --port whose gRPC twin (port + 10000) passes 65535; the ephemeral
    range reaches 60999, so free ports are drawn at or below MAX_SERVER_PORT."""
    from agentrl.engine.sglang.launcher import MAX_SERVER_PORT, MIN_SERVER_PORT, free_ports

    ports = free_ports(64)
    assert len(set(ports)) == 64
    assert max(ports) <= MAX_SERVER_PORT and MAX_SERVER_PORT + 10000 <= 65535
    assert min(ports) >= MIN_SERVER_PORT >= 20000  # Ray's worker ports are 10002-19999
