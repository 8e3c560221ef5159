"""The one supervisor over servers launched from this process, against a stand-in `sglang`
package (tests/engine/fixtures/fake_sglang) whose `sglang.launch_server` starts agentrl's own
server: flags and passthrough arguments, health wait, a dead server reported with its last log
lines, restarts (of a server and of the router), and who stops the servers."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentrl.config import ClusterConfig, EngineConfig, RunConfig
from agentrl.deploy.plan import Deployment, in_process_plan
from agentrl.deploy.processes import ManagedProcess, SGLangNotInstalled, free_ports
from agentrl.deploy.servers import LocalServer, local_supervisor
from agentrl.deploy.supervisor import RouterOptions, ServerSupervisor
from agentrl.engine.base import EngineError, SamplingParams
from agentrl.engine.sglang.router_admin import list_workers

FAKE_SGLANG = Path(__file__).parents[1] / "engine" / "fixtures" / "fake_sglang"
FAKE_SMG = Path(__file__).parent / "fixtures" / "fake_smg"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Servers started from here find the stand-in; each records its argv in the directory
    returned."""
    monkeypatch.syspath_prepend(str(FAKE_SGLANG))
    path = [str(FAKE_SGLANG), str(REPO), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
    monkeypatch.setenv("FAKE_SGLANG_ARGV_DIR", str(tmp_path))
    return tmp_path


def _engine(**kw) -> EngineConfig:
    return EngineConfig(kind="sglang", port=0, mem_fraction_static=0.5, **kw)


def _plan(**cluster) -> Deployment:
    cfg = RunConfig(engine=_engine(), cluster=ClusterConfig(**cluster))
    return in_process_plan(cfg, use_gpu=False)


def _supervisor(engine: EngineConfig, plan: Deployment) -> ServerSupervisor:
    return local_supervisor(engine, plan, "/models/x", health_timeout_s=60)


def test_missing_sglang_extra_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a)
    )
    with pytest.raises(
        SGLangNotInstalled, match=r"pip install 'agentrl\[sglang\]'.*engine.kind=http"
    ):
        _supervisor(_engine(), _plan())


def test_a_router_needs_its_package_before_any_server_starts(fake_sglang: Path) -> None:
    if importlib.util.find_spec("sglang_router") or importlib.util.find_spec("smg"):
        pytest.skip("a router package is installed here")
    plan = _plan(rollout_num_gpus=2, use_sglang_router=True)
    assert (plan.num_engines, plan.use_router) == (2, True)
    with pytest.raises(SGLangNotInstalled, match="sglang_router"):
        _supervisor(_engine(), plan)
    assert not list(fake_sglang.glob("*.json"))  # nothing started


async def test_server_that_dies_at_startup_fails_the_launch_with_its_log(
    fake_sglang: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SGLANG_FAIL_AT_START", "1")
    supervisor = _supervisor(_engine(), _plan())
    with pytest.raises(
        EngineError, match="(?s)failed to start.*exited with code 1.*Not enough memory"
    ):
        await supervisor.start()


async def test_a_servers_key_reaches_sglangs_argv_but_not_its_command_line(
    fake_sglang: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38: `ps` shows every local user a command line; the key goes in the environment,
    and the keyed launcher adds `--api-key` inside the process (SGLang reads no variable)."""
    monkeypatch.setenv("FAKE_SGLANG_FAIL_AT_START", "1")  # records its argv, then exits
    supervisor = _supervisor(_engine(api_key="k3y"), _plan())
    (server,) = supervisor.servers
    assert isinstance(server, LocalServer) and "k3y" not in server.process.cmd
    with pytest.raises(EngineError, match="failed to start"):
        await supervisor.start()
    (argv,) = [json.loads(p.read_text()) for p in fake_sglang.glob("*.json")]
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


def _crashed(tmp_path: Path) -> ManagedProcess:
    """A process that died at its first start; it serves when started again."""
    tmp_path.mkdir(exist_ok=True)
    (port,) = free_ports(1)
    cmd = [sys.executable, "-c", CRASH_ONCE, str(tmp_path / "crashed"), str(port)]
    process = ManagedProcess("sglang-server-0", f"http://127.0.0.1:{port}", cmd, tmp_path / "s.log")
    process.start()
    assert process.proc is not None
    process.proc.wait(timeout=30)
    return process


def _crashing_supervisor(tmp_path: Path, max_restarts: int) -> ServerSupervisor:
    process = _crashed(tmp_path)
    supervisor = ServerSupervisor(
        [LocalServer(process, health_timeout_s=60)], max_restarts=max_restarts
    )
    supervisor.urls = [process.url]  # it was started (and died)
    return supervisor


async def test_a_dead_server_past_its_restarts_stops_the_run_with_its_log(tmp_path: Path) -> None:
    supervisor = _crashing_supervisor(tmp_path, max_restarts=0)
    try:
        report = await supervisor.failure_report()  # what a client's connection error quotes
        assert report is not None and "exited with code 3" in report
        assert "CUDA out of memory" in report
        with pytest.raises(RuntimeError, match="(?s)engine 0 .*limit 0.*CUDA out of memory"):
            await supervisor.heal()
        assert supervisor.num_restarts == [0] and not await supervisor.servers[0].is_alive()
    finally:
        await supervisor.stop()


async def test_heal_restarts_a_dead_server_and_reports_it_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    supervisor = _crashing_supervisor(tmp_path, max_restarts=1)
    try:
        with caplog.at_level("WARNING", logger="agentrl.deploy.supervisor"):
            assert await supervisor.heal() == [0]
            assert await supervisor.heal() == []  # alive again: nothing to do, nothing reported
        (record,) = caplog.records
        assert "restarting (1/1)" in record.message and "CUDA out of memory" in record.message
        assert await supervisor.failure_report() is None
        assert supervisor.num_restarts == [1]
    finally:
        await supervisor.stop()
    assert not await supervisor.servers[0].is_alive()


async def test_heal_restarts_a_dead_router_on_its_port(tmp_path: Path) -> None:
    """The router is supervised too: restarted where it was, the servers left alone."""
    supervisor = _crashing_supervisor(tmp_path / "s", max_restarts=1)
    assert await supervisor.heal() == [0]  # the server serves now
    router = _crashed(tmp_path / "r")
    supervisor.router = router
    try:
        assert await supervisor.failure_report() is not None  # the router's exit, with its log
        assert await supervisor.heal() == []  # no server died
        assert router.is_alive() and await supervisor.failure_report() is None
        assert supervisor.num_restarts == [1] and supervisor.router_url == router.url
    finally:
        await supervisor.stop()
    assert not router.is_alive()


async def _listed(router_url: str, api_key: str) -> list[str]:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {api_key}"}) as client:
        return sorted(w["url"] for w in await list_workers(client, router_url))


async def test_a_router_starts_over_the_servers_takes_a_restarted_one_and_is_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cluster.use_sglang_router: the router (smg's worker API; a stand-in package here) starts
    over the servers, keyed off its command line; a restarted server takes its place in it; a
    dead router is restarted on its port."""
    monkeypatch.syspath_prepend(str(FAKE_SMG))  # choose_router looks in this process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_SMG), str(REPO)])}
    servers = [LocalServer(_crashed(tmp_path / name), health_timeout_s=60) for name in "ab"]
    router = RouterOptions(tmp_path / "router.log", "consistent_hashing", env=env)
    supervisor = ServerSupervisor(servers, max_restarts=1, router=router, api_key="k3y")
    try:
        urls = await supervisor.start()
        assert supervisor.router is not None and "k3y" not in supervisor.router.cmd
        router_url = supervisor.router.url
        assert await _listed(router_url, "k3y") == sorted(urls)
        servers[0].process.stop()
        assert await supervisor.heal() == [0]
        assert supervisor.urls == urls and await _listed(router_url, "k3y") == sorted(urls)
        supervisor.router.stop()
        assert await supervisor.heal() == []  # the router alone died
        assert supervisor.router.is_alive() and supervisor.router_url == router_url
    finally:
        await supervisor.stop()
    assert supervisor.router is not None and not supervisor.router.is_alive()


@pytest.mark.slow
async def test_launched_servers_generate_report_a_crash_restart_and_stop_with_their_group(
    fake_sglang: Path,
    tiny_model_path: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """engine.kind=sglang: the group supervises the servers; a client explains a dropped
    connection with the dead server's log; a client closing leaves the servers up."""
    from agentrl.deploy.launch import open_engines

    trigger = tmp_path / "crash-now"
    monkeypatch.setenv("FAKE_SGLANG_CRASH_TRIGGER", str(trigger))
    cfg = RunConfig()
    cfg.model.path = tiny_model_path
    cfg.engine = _engine(sglang_args=["--context-length", "512"], max_retries=0)
    cfg.cluster.max_engine_restarts = 1
    engines = await open_engines(cfg)
    supervisor = engines.supervisor  # type: ignore[attr-defined]
    engine = engines.engine
    try:
        completion = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, seed=0))
        assert len(completion.ids) == len(completion.logprobs) > 0
        (argv,) = [json.loads(p.read_text()) for p in fake_sglang.glob("*.json")]
        assert argv[argv.index("--model-path") + 1] == tiny_model_path
        assert argv[argv.index("--mem-fraction-static") + 1] == "0.5"
        assert argv[-2:] == ["--context-length", "512"]

        trigger.touch()
        deadline = time.monotonic() + 60
        while await supervisor.failure_report() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        report = await supervisor.failure_report()
        assert report is not None and "exited with code 3" in report
        assert "simulated CUDA error" in report
        with pytest.raises(EngineError, match="simulated CUDA error"):
            await engine.generate([1, 2], SamplingParams(max_new_tokens=2))
        assert await engines.heal() == [0]  # what the run's Runtime.heal_engines calls,
        engines.mark_all_up()  # then syncs the weights and marks the servers up
        assert supervisor.num_restarts == [1]
        assert (await engine.generate([1, 2], SamplingParams(max_new_tokens=2, seed=0))).ids
        await engines.servers()[0].close()  # a client owns no server
        assert await supervisor.servers[0].is_alive()
    finally:
        await engines.close()
    assert not await supervisor.servers[0].is_alive()


@pytest.mark.slow
def test_a_run_in_this_process_trains_through_two_servers_it_launched(
    fake_sglang: Path, tiny_model_path: str, tmp_path: Path
) -> None:
    """engine.kind=sglang sized by slime's flag (two servers, no Ray), keyed by engine.api_key:
    the trainer's weights reach both servers (by URL, with the key) after every step, each
    episode stays on one server, and the servers end with the run."""
    import psutil

    from agentrl.run import train
    from agentrl.types import read_jsonl
    from tests.support.configs import tiny_train_config

    cfg = tiny_train_config(tiny_model_path, tmp_path / "run", rollout_num_gpus=2)
    cfg.engine = _engine(api_key="k3y")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert train(cfg).num_steps == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["weight_sync/max_logprob_abs_diff"] < 1e-4 for r in steps), steps
    trajs = read_jsonl(str(tmp_path / "run" / "rollouts" / "step_000002.jsonl"))
    assert {t.turns[0].weight_version for t in trajs} == {1}
    assert all(len({turn.served_by for turn in t.turns}) == 1 for t in trajs)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    servers = [p for p in left if "sglang.launch_server" in " ".join(p.cmdline())]
    assert not [p for p in servers if p.status() != "zombie"]  # torch's shm manager may stay
