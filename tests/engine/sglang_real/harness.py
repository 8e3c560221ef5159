"""SGLang's own HTTP server (`sglang.srt.entrypoints.http_server.app`) with a stand-in for the
GPU scheduler behind it, as its own process:

    AGENTRL_SGLANG_PATH=DIR python -m tests.engine.sglang_real.harness --model-path P --port N ...
    AGENTRL_SGLANG_PATH=DIR python -m tests.engine.sglang_real.harness --print-server-args ...

The command line is SGLang's (`ServerArgs` parses it); the app, its routes, request classes and
error bodies are SGLang's. `StandInTokenizerManager` takes the place of SGLang's TokenizerManager
and scheduler processes: it implements the methods the routes call, with the scheduler's answers
(standin_requests.py, standin_weights.py). Two routes are the harness's own, for tests to look
inside: `GET /_standin/state` and `POST /_standin/hold`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace
from typing import Any

from tests.engine.sglang_real.standin_lora import LoraStandIn
from tests.engine.sglang_real.standin_requests import RequestStandIn
from tests.engine.sglang_real.standin_weights import WeightStandIn
from tests.support.sglang_real import import_sglang


class StandInTokenizerManager(RequestStandIn, WeightStandIn, LoraStandIn):
    """What SGLang's routes read and call on `_global_state.tokenizer_manager`."""

    def __init__(self, sglang: Any, server_args: Any, *, has_sessions: bool) -> None:
        from sglang.srt.managers.tokenizer_manager import ServerStatus

        self.server_args = server_args
        self.model_path = server_args.model_path
        self.served_model_name = server_args.served_model_name or server_args.model_path
        self.is_generation = True
        self.model_config = SimpleNamespace(  # what /model_info reads
            is_image_understandable_model=False,
            is_audio_understandable_model=False,
            hf_config=SimpleNamespace(model_type="llama", architectures=["LlamaForCausalLM"]),
            context_len=4096,
        )
        self.tokenizer = None
        self.max_req_input_len = 4096
        self._weight_version: str | None = None
        self.gracefully_exit = False
        self.server_status = ServerStatus.Up
        self.startup_time: dict[str, Any] = {}
        self.initial_weights_loaded = True
        self.worker_id = 0
        self._subprocess_watchdog = None
        self._init_requests(sglang)
        self._init_weights(sglang, tp_size=server_args.tp_size, has_sessions=has_sessions)
        self._init_lora()

    @property
    def weight_version(self) -> str:
        """On ServerArgs where SGLang before 0.5.2x keeps it (its /update_weight_version route
        sets `server_args.weight_version` itself); 0.5.2x's ServerArgs is read-only once
        resolved, so there the manager keeps its own (as its config bags do)."""
        return self._weight_version or self.server_args.weight_version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        try:
            self.server_args.weight_version = version
        except AttributeError:
            self._weight_version = version

    def config_value(self, name: str) -> Any:
        if name == "weight_version":
            return self.weight_version
        if name == "model_path":
            return self.model_path
        return getattr(self.server_args, name, None)

    def is_healthy(self) -> bool:
        return self.death is None

    def is_ready(self) -> bool:
        return not self.is_pause and self.is_healthy()

    def auto_create_handle_loop(self) -> None:
        return None

    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [{"weight_version": self.weight_version}]

    def set_server_stop_hook(self, hook: Any) -> None:
        return None

    def set_startup_time(self, startup_time: dict[str, Any]) -> None:
        self.startup_time = startup_time

    def configure_logging(self, obj: Any) -> None:
        return None

    def state(self) -> dict[str, Any]:
        """What the harness's inspection route returns."""
        return {
            "weights": {
                name: {
                    "dtype": str(t.dtype),
                    "shape": list(t.shape),
                    "values": t.flatten().tolist(),
                }
                for name, t in self.weights.items()
            },
            "num_weight_loads": self.num_weight_loads,
            "weight_version": self.weight_version,
            "in_session": self.in_session,
            "groups": sorted(self.groups),
            "offload_tags": sorted(self.offload_tags),
            "memory_saver_paused": sorted(self.memory_saver_paused),
            "num_running": len(self.running()),
            "num_waiting": len(self.waiting()),
            "running_rids": sorted(r.rid for r in self.running()),
            "num_cached_sequences": len(self.prefix_cache),
            "is_pause": self.is_pause,
            "pause_mode": self.pause_mode,
            **self.lora_state(),
        }


PRINTED_ARGS = ("model_path", "host", "port", "tp_size", "base_gpu_id", "mem_fraction_static",
                "context_length", "api_key", "enable_memory_saver", "dtype")  # fmt: skip


def parse_server_args(argv: list[str]) -> Any:
    """SGLang's own parser, as `python -m sglang.launch_server` uses it."""
    from sglang.srt.server_args import ServerArgs

    if "--device" not in argv:  # the stand-in is the accelerator: SGLang must not look for one
        argv = [*argv, "--device", "cpu"]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def build_app(argv: list[str]) -> tuple[Any, Any, StandInTokenizerManager]:
    sglang = import_sglang()
    server_args = parse_server_args(argv)
    try:  # 0.5.2x: routes read the published config (get_serving(), get_disagg())
        from sglang.srt.runtime_context import publish

        publish(server_args, role="tokenizer")
    except ImportError:
        pass
    from sglang.srt.entrypoints import http_server

    paths = {getattr(r, "path", "") for r in http_server.app.routes}
    manager = StandInTokenizerManager(
        sglang, server_args, has_sessions="/begin_weight_update" in paths
    )
    http_server.set_global_state(
        http_server._GlobalState(
            tokenizer_manager=manager,
            template_manager=None,
            scheduler_info={"max_req_input_len": 4096, "max_total_num_tokens": 1 << 16},
        )
    )
    _add_inspection_routes(http_server.app, manager)
    return http_server.app, server_args, manager


def _add_inspection_routes(app: Any, manager: StandInTokenizerManager) -> None:
    from fastapi import Body

    @app.get("/_standin/state")
    async def standin_state() -> dict[str, Any]:
        return manager.state()

    @app.post("/_standin/hold")
    async def standin_hold(is_held: bool = Body(..., embed=True)) -> dict[str, Any]:
        await manager.set_hold(is_held)
        return manager.state()


def main(argv: list[str]) -> None:
    import uvicorn

    if argv[:1] == ["--print-server-args"]:  # what SGLang's parser made of a command line
        import_sglang()
        server_args = parse_server_args(argv[1:])
        print(json.dumps({name: getattr(server_args, name) for name in PRINTED_ARGS}, default=str))
        return

    app, server_args, _ = build_app(argv)
    started = time.monotonic()
    print(f"stand-in SGLang on {server_args.host}:{server_args.port}", flush=True)
    uvicorn.run(app, host=server_args.host, port=server_args.port, log_level="warning",
                lifespan="off", timeout_keep_alive=5)  # fmt: skip
    print(f"stand-in SGLang stopped after {time.monotonic() - started:.1f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
