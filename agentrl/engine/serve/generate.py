"""SGLang's native generation routes of `agentrl serve`: `/generate` (single or batched, by ids or
text) and the `/health` / `/health_generate` probe."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from agentrl.engine.base import Completion, SamplingParams
from agentrl.engine.serve.protocol import error_response, finish_reason_json, sampling_from_sglang
from agentrl.engine.serve.state import ServerState
from agentrl.engine.sglang.protocol import ROUTING_KEY_HEADER


def generate_response(
    state: ServerState,
    completion: Completion,
    rid: str,
    *,
    prompt_len: int,
    return_logprob: bool,
    skip_special_tokens: bool,
    started: float,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason_json(completion),
        "prompt_tokens": prompt_len,
        "weight_version": completion.weight_version,
        "completion_tokens": len(completion.ids),
        "cached_tokens": completion.cached_tokens,
        "e2e_latency": time.perf_counter() - started,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, i, None] for lp, i in zip(completion.logprobs, completion.ids, strict=False)
        ]
    text = state.decode(completion.ids, skip_special_tokens=skip_special_tokens)
    return {"text": text, "output_ids": completion.ids, "meta_info": meta}


def add_generate_routes(app: FastAPI, state: Any) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request, body: dict[str, Any] = Body(...)) -> Any:
        s: ServerState = state()
        # The episode's key (sglang-router's header): its turns reuse their prefix's K/V here.
        routing_key = request.headers.get(ROUTING_KEY_HEADER)
        if body.get("stream"):
            return error_response(
                "stream=true is not supported by agentrl serve; send stream=false"
            )
        input_ids = body.get("input_ids")
        if input_ids is None and body.get("text") is not None:
            text = body["text"]
            input_ids = (
                [s.tokenizer.encode(t, add_special_tokens=False) for t in text]
                if isinstance(text, list)
                else s.tokenizer.encode(text, add_special_tokens=False)
            )
        elif body.get("text") is not None:
            return error_response("text and input_ids cannot be provided at the same time")
        if not input_ids:
            return error_response("input_ids (or text) is required and must be non-empty")
        is_batch = isinstance(input_ids[0], list)
        batch = input_ids if is_batch else [input_ids]
        params = body.get("sampling_params") or {}
        params_list = params if isinstance(params, list) else [params] * len(batch)
        rid = body.get("rid") or uuid.uuid4().hex
        rids = (
            rid
            if isinstance(rid, list)
            else ([f"{rid}-{i}" for i in range(len(batch))] if is_batch else [rid])
        )
        started = time.perf_counter()
        try:
            completions = await asyncio.gather(
                *(
                    s.run(
                        [int(t) for t in ids], sampling_from_sglang(p), r, routing_key=routing_key
                    )
                    for ids, p, r in zip(batch, params_list, rids, strict=False)
                )
            )
        except ValueError as e:
            return error_response(str(e))
        except Exception as e:  # the engine failed: a 5xx the client may retry
            return error_response(f"{type(e).__name__}: {e}", status_code=500)
        outs = [
            generate_response(
                s,
                c,
                r,
                prompt_len=len(ids),
                return_logprob=bool(body.get("return_logprob")),
                skip_special_tokens=bool(p.get("skip_special_tokens", True)),
                started=started,
            )
            for c, ids, p, r in zip(completions, batch, params_list, rids, strict=False)
        ]
        # JSONResponse directly: FastAPI's encoder walk over every logprob pair costs more than the
        # model step for short generations.
        return JSONResponse(outs if is_batch else outs[0])

    @app.get("/health")
    @app.get("/health_generate")
    async def health_generate() -> Response:
        s: ServerState = state()
        if "weights" in s.released_tags:
            return Response(status_code=503)
        if s.requests:  # already generating: that proves health (as SGLang does)
            return Response(status_code=200)
        try:
            probe = SamplingParams(temperature=0.0, max_new_tokens=1)
            await asyncio.wait_for(s.engine.generate([0], probe), timeout=20.0)
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)
