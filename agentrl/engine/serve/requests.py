"""`/generate`'s request body, validated (SGLang's `io_struct.GenerateReqInput` fields, strict
types), the server's bounds, and the one-line 400 that names a bad field."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.engine.base import SamplingParams


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of `agentrl serve` (`agentrl serve --help` names the flags)."""

    max_body_bytes: int = 32 * 2**20
    max_prompts: int = 256  # prompts in one /generate batch, or OpenAI prompts x n
    max_n: int = 64  # OpenAI `n`
    context_len: int | None = None  # None: the engine's (its KV slots and the model's positions)
    group_timeout_s: float = 60.0  # /init_weights_update_group's rendezvous


_STRICT = ConfigDict(strict=True, extra="ignore")  # unknown SGLang fields are ignored, as there


class SamplingParamsInput(BaseModel):
    """SGLang's `sampling_params` (defaults as in its `SamplingParams`)."""

    model_config = _STRICT

    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = -1
    max_new_tokens: int = Field(default=128, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    n: int = Field(default=1, ge=1, le=1)  # this server samples one completion per prompt

    def to_sampling(self, max_new_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=max_new_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            seed=self.sampling_seed,
        )


class GenerateReqInput(BaseModel):
    """The `/generate` fields this server reads; a batch is a list of prompts with, optionally,
    one `sampling_params` and one `rid` per prompt (exactly as many)."""

    model_config = _STRICT

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsInput | list[SamplingParamsInput] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    stream: bool = False
    lora_path: str | list[str | None] | None = None  # the LoRA adapter, by its lora_name

    @model_validator(mode="after")
    def _consistent(self) -> GenerateReqInput:
        if self.text is not None and self.input_ids is not None:  # SGLang's messages
            raise ValueError("text and input_ids cannot be provided at the same time")
        if self.text is None and self.input_ids is None:
            raise ValueError("Either text or input_ids should be provided (not both)")
        prompts = self.text if self.text is not None else self.input_ids
        if not prompts or (self.is_batch and not all(prompts)):  # type: ignore[arg-type]
            raise ValueError("the prompt is empty; give at least one token (or character)")
        n = self.num_prompts
        for field in ("sampling_params", "rid"):
            value = getattr(self, field)
            if isinstance(value, list) and (not self.is_batch or len(value) != n):
                raise ValueError(
                    f"{field} is a list of {len(value)} for {n if self.is_batch else 'one'} "
                    f"prompt(s); give one per prompt, or a single {field} for all"
                )
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)  # type: ignore[index]

    @property
    def num_prompts(self) -> int:
        prompts = self.text if self.text is not None else self.input_ids
        return len(prompts) if self.is_batch else 1  # type: ignore[arg-type]

    def sampling_list(self) -> list[SamplingParamsInput]:
        p = self.sampling_params
        return p if isinstance(p, list) else [p or SamplingParamsInput()] * self.num_prompts

    def rid_list(self, default: str) -> list[str]:
        if isinstance(self.rid, list):
            return self.rid
        rid = self.rid or default
        return [f"{rid}-{i}" for i in range(self.num_prompts)] if self.is_batch else [rid]


def validation_message(errors: list[Any]) -> str:
    """Pydantic's errors -> one line naming each field, what was wrong and the value sent."""
    parts = []
    for e in errors[:3]:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        got = repr(e.get("input"))
        parts.append(f"{loc}: {e.get('msg')} (got {got[:60]}{'...' if len(got) > 60 else ''})")
    more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
    return "invalid request: " + "; ".join(parts) + more


def engine_context_len(engine: Any, tokenizer: Any, limit: int | None) -> int | None:
    """Tokens one sequence may reach: the engine's KV slot length and the model's positions (or
    the tokenizer's `model_max_length` for an engine that says neither), at most `limit`."""
    config = getattr(getattr(engine, "model", None), "config", None)
    known = [
        getattr(getattr(engine, "arena", None), "max_len", None),
        getattr(config, "max_position_embeddings", None),
        limit,
    ]
    lengths = [int(n) for n in known if isinstance(n, int) and n > 0]
    if not lengths and isinstance(getattr(tokenizer, "model_max_length", None), int):
        lengths = [tokenizer.model_max_length] if tokenizer.model_max_length < 1 << 30 else []
    return min(lengths) if lengths else None


def fit_to_context(
    field: str, prompt_len: int, max_new_tokens: int, context_len: int | None
) -> int:
    """SGLang's length check: a prompt that fills the context is refused (400 naming `field`);
    `max_new_tokens` is capped to the room left (as SGLang's `--allow-auto-truncate` does)."""
    if context_len is None:
        return max_new_tokens
    if prompt_len >= context_len:
        raise ValueError(
            f"{field}: the input ({prompt_len} tokens) is longer than the model's context length "
            f"({context_len} tokens); shorten the prompt"
        )
    return min(max_new_tokens, context_len - prompt_len)


async def tokenize(tokenizer: Any, texts: list[str], **kwargs: Any) -> list[list[int]]:
    """Off the event loop: a long text takes seconds to tokenize, and the server must keep
    answering (health probes, aborts) meanwhile."""
    if tokenizer is None:
        raise ValueError("text: this server has no tokenizer; send input_ids")
    return await asyncio.to_thread(lambda: [list(tokenizer.encode(t, **kwargs)) for t in texts])
