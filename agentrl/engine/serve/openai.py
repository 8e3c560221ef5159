"""OpenAI-compatible routes of `agentrl serve`: `/v1/models`, `/v1/completions`,
`/v1/chat/completions`, with logprobs and token ids in SGLang 0.5.23's shape: chat choices get
`prompt_token_ids`/`response_token_ids` with `"return_token_ids": true` (prompt ids alone with
`return_prompt_token_ids`), completion choices `token_ids`/`prompt_token_ids`; responses carry
`metadata.weight_version`. `stream: true` answers as server-sent events once sampling ends.
agentrl's older fields stay: chat `choices[i].token_ids`, top-level `prompt_token_ids` and
`weight_version`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from agentrl.engine.base import Completion, FinishReason, SamplingParams
from agentrl.engine.serve.protocol import error_response
from agentrl.engine.serve.requests import fit_to_context, tokenize
from agentrl.engine.serve.state import (
    ClientDisconnectedError,
    ServerState,
    State,
    cancel_on_disconnect,
)
from agentrl.model_store import eos_token_ids


class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are ignored, as SGLang does

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = None
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    return_token_ids: bool = False


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = None


class ChatMessage(BaseModel):
    """One request message: its role checked (SGLang's `ChatCompletionMessageParam` roles; any
    other is a 400 naming it), its other fields passed to the chat template as sent."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Any = None


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    return_prompt_token_ids: bool = False


def _finish(c: Completion) -> str:
    return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(c.finish_reason, "abort")


def _sampling(
    req: _OpenAIRequest, max_new_tokens: int, stop_token_ids: list[int], index: int
) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        max_new_tokens=max_new_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        seed=None if req.seed is None else req.seed + index,  # n choices must differ
    )


def _message_text(content: Any) -> str:
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


router = APIRouter()


@router.get("/v1/models")
async def list_models(s: State) -> dict[str, Any]:
    card = {
        "id": s.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "agentrl",
        "root": s.served_model_name,
        # the engine's context (its KV slots, the model's positions, --context-length), as
        # /server_info says: a tokenizer's model_max_length may be the 1e30 "no limit" sentinel
        "max_model_len": s.context_len,
    }
    return {"object": "list", "data": [card]}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, s: State) -> Any:
    try:
        prompts = await _prompt_ids(s.tokenizer, req.prompt)
        jobs = [(p, i) for p in prompts for i in range(req.n)]
        _check_count(s, req.n, len(jobs))
        max_tokens = req.max_tokens or 16
        sampling = [
            _sampling(req, fit_to_context("prompt", len(p), max_tokens, s.context_len), [], i)
            for p, i in jobs
        ]
        outs = await _sample(s, request, [p for p, _ in jobs], sampling)
    except ValueError as e:
        return error_response(str(e))
    except ClientDisconnectedError:
        return Response(status_code=499)
    choices = [
        _completion_choice(s, req, index, c, prompt)
        for index, ((prompt, _), c) in enumerate(zip(jobs, outs, strict=False))
    ]
    response = _response(s, "cmpl", "text_completion", choices, [len(p) for p, _ in jobs], outs)
    return streamed(response, completion_chunks) if req.stream else response


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, s: State) -> Any:
    """With the server's `tool_parser`, replies to requests with `tools` carry OpenAI's
    `tool_calls` (finish_reason "tool_calls") instead of the raw call text."""
    messages = [{**m.model_dump(), "content": _message_text(m.content)} for m in req.messages]
    try:
        prompt = await asyncio.to_thread(_chat_prompt, s.tokenizer, messages, req.tools)
    except Exception as e:
        return error_response(
            f"messages: the chat template failed on them: {type(e).__name__}: {e}"
        )
    try:
        _check_count(s, req.n, req.n)
        max_tokens = req.max_completion_tokens or req.max_tokens or 256
        max_new_tokens = fit_to_context("messages", len(prompt), max_tokens, s.context_len)
        stop_ids = eos_token_ids(s.tokenizer)
        sampling = [_sampling(req, max_new_tokens, stop_ids, i) for i in range(req.n)]
        outs = await _sample(s, request, [prompt] * req.n, sampling)
    except ValueError as e:
        return error_response(str(e))
    except ClientDisconnectedError:
        return Response(status_code=499)
    choices = [_chat_choice(s, req, index, c, prompt) for index, c in enumerate(outs)]
    response = _response(s, "chatcmpl", "chat.completion", choices, [len(prompt)] * len(outs), outs)
    if req.return_token_ids:
        response["prompt_token_ids"] = list(prompt)
    return streamed(response, chat_chunks) if req.stream else response


async def _sample(
    s: ServerState, request: Request, prompts: list[list[int]], sampling: list[SamplingParams]
) -> list[Completion]:
    """Every prompt at once, under its own sampling; a client that goes away aborts them all
    (`ClientDisconnectedError`)."""
    runs = [
        s.generate(list(p), sp, uuid.uuid4().hex) for p, sp in zip(prompts, sampling, strict=True)
    ]
    return [g.completion for g in await cancel_on_disconnect(request, asyncio.gather(*runs))]


def _response(
    s: ServerState,
    id_prefix: str,
    kind: str,
    choices: list[dict[str, Any]],
    prompt_lens: list[int],
    outs: list[Completion],
) -> dict[str, Any]:
    num_prompt = sum(prompt_lens)
    num_completion = sum(len(c.ids) for c in outs)
    return {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": s.served_model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
        },
        "metadata": {"weight_version": str(s.weight_version)},
        "weight_version": str(s.weight_version),
    }


def _completion_choice(
    s: ServerState, req: CompletionRequest, index: int, c: Completion, prompt: list[int]
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "text": s.decode(c.ids),
        "finish_reason": _finish(c),
        "logprobs": None,
    }
    if req.logprobs is not None:
        tokens = [s.decode([t]) for t in c.ids]
        offsets = [sum(len(x) for x in tokens[:k]) for k in range(len(tokens))]
        choice["logprobs"] = {
            "tokens": tokens,
            "token_logprobs": c.logprobs,
            "top_logprobs": None,
            "text_offset": offsets,
        }
    if req.return_token_ids:
        choice["token_ids"] = c.ids
        choice["prompt_token_ids"] = prompt
    return choice


def _chat_choice(
    s: ServerState, req: ChatCompletionRequest, index: int, c: Completion, prompt: list[int]
) -> dict[str, Any]:
    content = s.decode(c.ids, skip_special_tokens=True)
    choice: dict[str, Any] = {
        "index": index,
        "message": {"role": "assistant", "content": content},
        "finish_reason": _finish(c),
        "logprobs": None,
    }
    if s.tool_parser is not None and req.tools:
        _with_tool_calls(choice, s.tool_parser(c.ids, req.tools))
    if req.logprobs:
        choice["logprobs"] = {
            "content": [
                {
                    "token": s.decode([t]),
                    "logprob": lp,
                    "bytes": list(s.decode([t]).encode()),
                    "top_logprobs": [],
                }
                for t, lp in zip(c.ids, c.logprobs, strict=False)
            ]
        }
    if req.return_token_ids or req.return_prompt_token_ids:
        choice["prompt_token_ids"] = list(prompt)
    if req.return_token_ids:
        choice["response_token_ids"] = choice["token_ids"] = c.ids
    return choice


def _with_tool_calls(choice: dict[str, Any], parsed: Any) -> None:
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": tc.name, "arguments": tc.arguments},
        }
        for tc in parsed.tool_calls
    ]
    choice["message"]["content"] = parsed.content or (None if calls else "")
    if calls:
        choice["message"]["tool_calls"] = calls
        if choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"


def streamed(response: dict[str, Any], chunks: Any) -> StreamingResponse:
    """`response` as server-sent events: `chunks(response)`'s events, then `[DONE]`."""

    async def events() -> AsyncIterator[str]:
        for chunk in chunks(response):
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def chat_chunks(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished chat response as OpenAI's `chat.completion.chunk` events: per choice its
    message (role, content, tool calls, token ids) then its finish reason."""
    head = {k: response[k] for k in ("id", "created", "model")}
    events = []
    for choice in response["choices"]:
        message = choice["message"]
        index = choice["index"]
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(message["tool_calls"])]
        extra = {k: choice[k] for k in ("prompt_token_ids", "response_token_ids") if k in choice}
        events.append({"index": index, "delta": delta, "finish_reason": None, **extra})
        events.append({"index": index, "delta": {}, "finish_reason": choice["finish_reason"]})
    last = {"metadata": response.get("metadata"), "usage": response.get("usage")}
    out = [{**head, "object": "chat.completion.chunk", "choices": [e]} for e in events]
    out[-1].update(last)
    return out


def completion_chunks(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished completion response as `text_completion` stream events."""
    head = {k: response[k] for k in ("id", "created", "model")}
    out = [{**head, "object": "text_completion", "choices": [dict(c)]} for c in response["choices"]]
    out[-1].update(metadata=response.get("metadata"), usage=response.get("usage"))
    return out


async def _prompt_ids(tokenizer: Any, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return await tokenize(tokenizer, [prompt])
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    if not prompt or any(not p for p in prompt):
        raise ValueError("prompt: empty; give at least one token (or character)")
    texts = [p for p in prompt if isinstance(p, str)]
    encoded = iter(await tokenize(tokenizer, texts)) if texts else iter(())
    return [next(encoded) if isinstance(p, str) else list(p) for p in prompt]


def _chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def _check_count(s: ServerState, n: int, num_sequences: int) -> None:
    if n > s.limits.max_n:
        raise ValueError(f"n={n} is over this server's limit of {s.limits.max_n}; ask for fewer")
    if num_sequences > s.limits.max_prompts:
        raise ValueError(
            f"prompt: {num_sequences} sequences (prompts x n) in one request, over this server's "
            f"limit of {s.limits.max_prompts}; split the request"
        )
