"""The SGLang client's LoRA side against a server that lacks `/load_lora_adapter_from_tensors`
(an SGLang build without it answers 404): one line naming the route, the server's version and the
way out, before any request names an adapter. The route's shapes on real SGLang code are
tests/engine/sglang_real/test_sglang_lora.py's."""

from __future__ import annotations

import asyncio

import pytest
import torch
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentrl.engine.base import EngineError
from agentrl.engine.sglang import SGLangEngine
from agentrl.weights.adapter import PEFT_PREFIX, AdapterExport
from tests.support.servers import run_app_in_thread


async def _server_info(request) -> JSONResponse:
    return JSONResponse({"version": "0.5.15", "tp_size": 1})


def test_a_server_without_the_adapter_route_is_refused_in_one_line() -> None:
    server = run_app_in_thread(Starlette(routes=[Route("/server_info", _server_info)]))
    client = SGLangEngine(server.url)
    module = f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj"
    adapter = AdapterExport(
        [
            (f"{module}.lora_A.weight", torch.ones(2, 4)),
            (f"{module}.lora_B.weight", torch.ones(4, 2)),
        ],
        {"r": 2, "lora_alpha": 4},
    )
    try:
        with pytest.raises(EngineError) as error:
            asyncio.run(client.weights.load_lora_adapter("agentrl-v1", adapter, weight_version=1))
        message = str(error.value)
        assert "\n" not in message and "(0.5.15) has no /load_lora_adapter_from_tensors" in message
        assert "train.lora_rank=0" in message and client.lora_name is None
    finally:
        server.stop()
