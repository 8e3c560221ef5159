"""`agentrl serve --api-key`: every route but the health probes answers 401 without the key (in
SGLang 0.5.23's body), with it the route runs; `--admin-api-key` alone opens the weight, memory and
cache routes; the key comes from the flag or AGENTRL_API_KEY."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from agentrl.engine.local import LocalEngine
from agentrl.engine.serve import create_app
from agentrl.engine.serve.auth import is_allowed
from tests.support.servers import run_app_in_thread

KEY, ADMIN_KEY = "s3cret-key", "admin-key"
ADMIN_ROUTES = {
    "/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
    "/destroy_weights_update_group", "/update_weights_from_distributed", "/update_weight_version",
    "/release_memory_occupation", "/resume_memory_occupation", "/flush_cache",
    "/begin_weight_update", "/end_weight_update", "/abort_request", "/pause_generation",
    "/continue_generation",
}  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_model_path: str) -> Iterator[LocalEngine]:
    engine = LocalEngine.load(tiny_model_path, device="cpu", seed=0)
    yield engine
    asyncio.run(engine.close())


def _serve(engine: LocalEngine, **keys: Any) -> Any:
    app = create_app(engine, **keys)
    # every route the app serves, as its schema lists them (included routers too)
    routes = [(m.upper(), path) for path, ops in app.openapi()["paths"].items() for m in ops]
    return run_app_in_thread(app), sorted(routes)


def test_every_route_but_health_wants_the_key(engine) -> None:
    thread, routes = _serve(engine, api_key=KEY)
    try:
        with httpx.Client(base_url=thread.url, timeout=60) as client:
            for method, path in routes:
                r = client.request(method, path, json={})
                if path.startswith("/health"):
                    assert r.status_code == 200, (method, path, r.text)
                else:
                    assert r.status_code == 401, (method, path, r.status_code)
                    assert r.json() == {"error": "Unauthorized"}
                wrong = client.request(method, path, json={}, headers={"Authorization": "Bearer x"})
                assert path.startswith("/health") or wrong.status_code == 401, (method, path)
            ok = {"Authorization": f"Bearer {KEY}"}
            assert client.get("/get_model_info", headers=ok).status_code == 200
            generated = client.post("/generate", json={"input_ids": [1, 2], "sampling_params":
                                    {"max_new_tokens": 2}}, headers=ok)  # fmt: skip
            assert generated.status_code == 200, generated.text
            assert client.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).is_success
            # A weight route with the key runs (and fails on its own terms, not 401).
            disk = client.post(
                "/update_weights_from_disk", json={"model_path": "/nope"}, headers=ok
            )
            assert disk.status_code == 400 and "/nope" in disk.json()["message"]
    finally:
        thread.stop()
    assert {path for _, path in routes} >= ADMIN_ROUTES


def test_the_admin_key_alone_opens_the_admin_routes(engine) -> None:
    thread, _ = _serve(engine, api_key=KEY, admin_api_key=ADMIN_KEY)
    user, admin = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN_KEY}"}
    try:
        with httpx.Client(base_url=thread.url, timeout=60) as client:
            for path in sorted(ADMIN_ROUTES):
                assert client.post(path, json={}, headers=user).status_code == 401, path
                assert client.post(path, json={}, headers=admin).status_code != 401, path
            assert client.get("/get_model_info", headers=user).status_code == 200
            assert client.get("/get_model_info", headers=admin).status_code == 401
    finally:
        thread.stop()


def test_without_keys_every_route_is_open_as_in_sglang() -> None:
    for path, admin_route in (("/generate", False), ("/update_weights_from_tensor", True)):
        assert is_allowed("POST", path, None, api_key=None, admin_api_key=None,
                          is_admin_route=admin_route)  # fmt: skip
    assert not is_allowed("POST", "/generate", "Basic s3cret-key", api_key=KEY,
                          admin_api_key=None, is_admin_route=False)  # fmt: skip
    assert is_allowed("OPTIONS", "/generate", None, api_key=KEY, admin_api_key=None,
                      is_admin_route=False)  # fmt: skip


@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_cli_passes_the_key_and_the_limits(
    monkeypatch: pytest.MonkeyPatch, engine, how: str
) -> None:
    import agentrl.engine.serve.app as serve_app
    from agentrl.cli import app

    seen: dict[str, Any] = {}
    monkeypatch.setattr(LocalEngine, "load", lambda *a, **k: engine)
    monkeypatch.setattr(serve_app, "serve", lambda engine, **options: seen.update(options))
    args = ["serve", "--max-body-mb", "2", "--max-n", "3", "--context-length", "100",
            "--weight-group-timeout-s", "5"]  # fmt: skip
    env = {"AGENTRL_API_KEY": KEY} if how == "env" else {}
    result = CliRunner().invoke(app, args + (["--api-key", KEY] if how == "flag" else []), env=env)
    assert result.exit_code == 0, result.output
    limits = seen["limits"]
    assert seen["api_key"] == KEY and seen["admin_api_key"] is None
    assert (limits.max_body_bytes, limits.max_n, limits.context_len) == (2 * 2**20, 3, 100)
    assert limits.group_timeout_s == 5.0
