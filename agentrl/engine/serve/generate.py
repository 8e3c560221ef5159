"""SGLang's native generation routes of `agentrl serve`: `/generate` (single or batched, by ids or
text) and the `/health` / `/health_generate` probe."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from agentrl.engine.base import SamplingParams
from agentrl.engine.serve.lora import check_lora_paths
from agentrl.engine.serve.protocol import finish_reason_json, generate_error
from agentrl.engine.serve.requests import GenerateReqInput, fit_to_context, tokenize
from agentrl.engine.serve.state import (
    ClientDisconnectedError,
    Generation,
    ServerState,
    State,
    cancel_on_disconnect,
)
from agentrl.engine.sglang.protocol import LOGPROB_TRUNCATED_KEY, ROUTING_KEY_HEADER


def generate_response(
    state: ServerState,
    generation: Generation,
    rid: str,
    *,
    prompt_len: int,
    return_logprob: bool,
    skip_special_tokens: bool,
    started: float,
) -> dict[str, Any]:
    completion = generation.completion
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason_json(completion),
        "prompt_tokens": prompt_len,
        "weight_version": str(completion.weight_version),
        "weight_versions": generation.weight_versions,
        "completion_tokens": len(completion.ids),
        "cached_tokens": completion.cached_tokens,
        "e2e_latency": time.perf_counter() - started,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, i, None] for lp, i in zip(completion.logprobs, completion.ids, strict=False)
        ]
        # agentrl's own key (SGLang has none): its logprobs are of the top-k/top-p truncated
        # distribution, which the trainer then replays; SGLang's are of the whole softmax.
        meta[LOGPROB_TRUNCATED_KEY] = completion.is_logprob_truncated
    text = state.decode(completion.ids, skip_special_tokens=skip_special_tokens)
    return {"text": text, "output_ids": completion.ids, "meta_info": meta}


router = APIRouter()


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(obj: GenerateReqInput, request: Request, s: State) -> Any:
    # The episode's key (sglang-router's header): its turns reuse their prefix's K/V here.
    routing_key = request.headers.get(ROUTING_KEY_HEADER)
    if obj.stream:
        return generate_error("stream=true is not supported by agentrl serve; send stream=false")
    if obj.num_prompts > s.limits.max_prompts:
        return generate_error(
            f"input_ids: {obj.num_prompts} prompts in one request, over this server's limit "
            f"of {s.limits.max_prompts}; split the batch (or raise --max-prompts)"
        )
    started = time.perf_counter()
    try:
        check_lora_paths(s, obj.lora_path)
        batch = await _prompt_ids(s, obj)
        params = obj.sampling_list()
        field = "text" if obj.text is not None else "input_ids"
        sampling = [
            p.to_sampling(fit_to_context(field, len(ids), p.max_new_tokens, s.context_len))
            for ids, p in zip(batch, params, strict=True)
        ]
        rids = obj.rid_list(uuid.uuid4().hex)
        runs = [
            s.generate(ids, sp, r, routing_key=routing_key)
            for ids, sp, r in zip(batch, sampling, rids, strict=True)
        ]
        generations = await cancel_on_disconnect(request, asyncio.gather(*runs))
    except ValueError as e:
        return generate_error(str(e))
    except ClientDisconnectedError:  # nobody reads this; the generation was aborted
        return Response(status_code=499)
    except Exception as e:  # the engine failed: a 5xx the client may retry
        return generate_error(f"{type(e).__name__}: {e}", status_code=500)
    respond = functools.partial(
        generate_response, s, return_logprob=obj.return_logprob, started=started
    )
    outs = [
        respond(g, r, prompt_len=len(ids), skip_special_tokens=p.skip_special_tokens)
        for g, ids, p, r in zip(generations, batch, params, rids, strict=True)
    ]
    # JSONResponse directly: FastAPI's encoder walk over every logprob pair costs more than the
    # model step for short generations.
    return JSONResponse(outs if obj.is_batch else outs[0])


@router.get("/health")
@router.get("/health_generate")
async def health_generate(s: State) -> Response:
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


async def _prompt_ids(s: ServerState, obj: GenerateReqInput) -> list[list[int]]:
    if obj.input_ids is not None:
        ids = obj.input_ids
        return [list(p) for p in ids] if obj.is_batch else [list(ids)]  # type: ignore[arg-type]
    texts = obj.text if isinstance(obj.text, list) else [obj.text or ""]
    return await tokenize(s.tokenizer, texts, add_special_tokens=False)
