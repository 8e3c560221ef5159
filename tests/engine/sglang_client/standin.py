"""A stand-in SGLang server for the client's tests: it speaks one release's dialect and enforces
the rules of SGLang 0.5.23 the client must follow (its http_server.py, io_struct.py and the
scheduler's weight_updater.py): weight updates inside a session, 404 for removed routes, 401
without the API key, 400 for a live duplicate `rid` and for a flush while requests are queued,
and death on a resume of memory never released. Records every request."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tests.support.servers import run_app_in_thread

GENERATED = {
    "text": "",
    "output_ids": [7],
    "meta_info": {
        "id": "x",
        "finish_reason": {"type": "length", "length": 1},
        "weight_version": "default",
        "output_token_logprobs": [[-0.5, 7, None]],
        "prompt_tokens": 2,
        "cached_tokens": 0,
    },
}


class StandIn:
    def __init__(
        self,
        version: str = "0.5.23",
        *,
        has_new_routes: bool = True,
        has_sessions: bool = True,
        api_key: str | None = None,
        tp_size: int = 1,
    ) -> None:
        self.version, self.has_new_routes, self.has_sessions = version, has_new_routes, has_sessions
        self.api_key, self.tp_size = api_key, tp_size
        self.requests: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.is_session_open = False
        self.num_flush_refusals = 0  # answered 400 ("requests queued") before a flush succeeds
        self.generate_statuses: list[int] = []  # one per /generate, then 200
        self.live_rids: set[str] = set()
        self.released: set[str] = set()
        self.is_dead = False
        self.weight_version = "default"
        self.app = FastAPI()
        self.app.middleware("http")(self._auth)
        self.app.api_route("/{path:path}", methods=["GET", "POST"])(self._route)

    async def _auth(self, request: Request, call_next: Any) -> Any:
        # SGLang's decide_request_auth: /health* stays open, everything else wants the key.
        is_open = request.url.path.startswith("/health")
        is_authorized = request.headers.get("authorization") == f"Bearer {self.api_key}"
        if self.api_key and not is_open and not is_authorized:
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    def start(self) -> StandIn:
        self.thread = run_app_in_thread(self.app)
        self.url = self.thread.url
        return self

    def stop(self) -> None:
        self.thread.stop()

    def paths(self) -> list[str]:
        return [p for p, _, _ in self.requests]

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [b for p, b, _ in self.requests if p == path]

    async def _route(self, path: str, request: Request) -> Any:
        import json

        raw = await request.body()
        body = json.loads(raw) if raw else {}
        path = f"/{path}"
        self.requests.append((path, body, dict(request.headers)))
        if self.is_dead:
            return Response(status_code=502)
        handler = getattr(self, "_" + path.strip("/").replace("/", "_"), None)
        if handler is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return handler(body)

    # -- info

    def _info(self) -> dict[str, Any]:
        return {"version": self.version, "tp_size": self.tp_size, "internal_states": [{}]}

    def _server_info(self, _: dict[str, Any]) -> Any:
        return self._info() if self.has_new_routes else _not_found()

    def _get_server_info(self, _: dict[str, Any]) -> Any:
        return self._info()

    def _model_info(self, _: dict[str, Any]) -> Any:
        if not self.has_new_routes:
            return _not_found()
        return {"model_path": "m", "weight_version": self.weight_version}

    def _get_model_info(self, _: dict[str, Any]) -> Any:
        return {"model_path": "m", "weight_version": self.weight_version}

    def _health_generate(self, _: dict[str, Any]) -> Any:
        return Response(status_code=200)

    def _health(self, _: dict[str, Any]) -> Any:
        return Response(status_code=200)

    # -- generation

    def _generate(self, body: dict[str, Any]) -> Any:
        rid = body.get("rid")
        if rid in self.live_rids:
            return JSONResponse({"error": {"message": f"Duplicate request ID: {rid}"}}, 400)
        if self.generate_statuses:  # the first attempt fails on the way back, still running here
            self.live_rids.add(rid)
            return JSONResponse({"error": "busy"}, status_code=self.generate_statuses.pop(0))
        return GENERATED

    # -- control

    def _pause_generation(self, _: dict[str, Any]) -> Any:
        return {"message": "Generation paused successfully.", "status": "ok"}

    def _continue_generation(self, _: dict[str, Any]) -> Any:
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _abort_request(self, _: dict[str, Any]) -> Any:
        return Response(status_code=200)

    def _v1_loads(self, _: dict[str, Any]) -> Any:
        return {"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]}

    def _flush_cache(self, _: dict[str, Any]) -> Any:
        if self.num_flush_refusals:
            self.num_flush_refusals -= 1
            return Response("Cache not flushed: requests queued.\n", status_code=400)
        return Response("Cache flushed.\n", status_code=200)

    def _release_memory_occupation(self, body: dict[str, Any]) -> Any:
        self.released |= set(body.get("tags") or ("weights", "kv_cache", "cuda_graph"))
        return None

    def _resume_memory_occupation(self, body: dict[str, Any]) -> Any:
        tags = set(body.get("tags") or ("weights", "kv_cache", "cuda_graph"))
        if tags - self.released:  # torch_memory_saver: resuming what was never paused
            self.is_dead = True
            return Response(status_code=502)
        self.released -= tags
        return None

    # -- weights

    def _begin_weight_update(self, _: dict[str, Any]) -> Any:
        if not self.has_sessions:
            return _not_found()
        if self.is_session_open:
            return _failure("a weight-update session is already open; call end_weight_update()")
        self.is_session_open = True
        return {"success": True, "message": "ok"}

    def _end_weight_update(self, _: dict[str, Any]) -> Any:
        if not self.has_sessions:
            return _not_found()
        if not self.is_session_open:
            return _failure("no weight-update session is open; call begin_weight_update() first")
        self.is_session_open = False
        return {"success": True, "message": "ok"}

    def _update(self, body: dict[str, Any], route: str) -> Any:
        if self.has_sessions and not self.is_session_open:
            return _failure(
                f"{route} must run between begin_weight_update() and end_weight_update()"
            )
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return {"success": True, "message": "ok"}

    def _update_weights_from_tensor(self, body: dict[str, Any]) -> Any:
        return self._update(body, "update_weights_from_tensor")

    def _update_weights_from_distributed(self, body: dict[str, Any]) -> Any:
        return self._update(body, "update_weights_from_distributed")

    def _update_weights_from_disk(self, body: dict[str, Any]) -> Any:
        self.weight_version = body.get("weight_version") or self.weight_version
        return {"success": True, "message": "ok", "num_paused_requests": 0}

    def _update_weight_version(self, body: dict[str, Any]) -> Any:
        self.weight_version = body["new_version"]
        return {"success": True, "message": "ok", "new_version": body["new_version"]}


def _not_found() -> Response:
    return JSONResponse({"detail": "Not Found"}, status_code=404)


def _failure(message: str) -> Response:
    return JSONResponse({"success": False, "message": message}, status_code=400)
