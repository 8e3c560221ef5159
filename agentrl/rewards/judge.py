"""`judge(rubric, ...)`: LLM-as-judge rewards through an agentrl engine or any OpenAI-compatible
URL. Concurrent `score` calls for one answer share one request, at most `max_concurrency`
requests are out at once, and verdicts are cached by (prompt, answer). A judge that cannot
answer raises `JudgeError`: raised inside `env.step` (or an agent) it ends the episode ERROR,
an infrastructure outcome kept out of the loss, never a reward of 0."""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from agentrl.rewards.rubric import JudgeCall, JudgeScore, Rubric
from agentrl.types import Message


class JudgeError(RuntimeError):
    """The judge could not score an answer (unreachable, refused, or unreadable replies)."""


Backend = Callable[[list[Message]], Awaitable[str]]


def openai_backend(
    url: str,
    *,
    model: str,
    api_key: str | None = None,
    timeout_s: float = 120.0,
    max_tokens: int = 256,
) -> Backend:
    """Chat completions at `url` (a base URL such as `http://127.0.0.1:30000/v1`), greedy."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoint = url.rstrip("/") + "/chat/completions"

    async def complete(messages: list[Message]) -> str:
        body = {
            "model": model,
            "messages": [m.to_dict() for m in messages],
            "temperature": 0.0,
            "max_tokens": max_tokens,
        }
        async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
            response = await client.post(endpoint, json=body)
        if response.status_code >= 400:
            raise JudgeError(
                f"judge {endpoint}: HTTP {response.status_code}: {response.text[:300]}"
            )
        return response.json()["choices"][0]["message"]["content"] or ""

    return complete


def engine_backend(engine: Any, codec: Any, *, max_tokens: int = 256) -> Backend:
    """An agentrl engine (LocalEngine, SGLangEngine) prompted through a ChatCodec, greedy."""
    from agentrl.engine.base import SamplingParams

    async def complete(messages: list[Message]) -> str:
        ids = codec.render_prompt(messages)
        sampling = SamplingParams(
            temperature=0.0, max_new_tokens=max_tokens, stop_token_ids=codec.stop_token_ids
        )
        completion = await engine.generate(ids, sampling)
        return codec.decode(codec.strip_end_of_turn(completion.ids))

    return complete


class Judge:
    """Scores answers against a rubric; one instance serves a whole run (its cache with it)."""

    def __init__(
        self,
        rubric: Rubric,
        backend: Backend,
        *,
        max_concurrency: int = 8,
        cache_size: int = 100_000,
        max_attempts: int = 2,
    ) -> None:
        for name, value in (("max_concurrency", max_concurrency), ("max_attempts", max_attempts)):
            if value < 1:
                raise ValueError(f"judge {name}={value}: use an int >= 1")
        self.rubric = rubric
        self.backend = backend
        self.max_concurrency = max_concurrency
        self.cache_size = cache_size
        self.max_attempts = max_attempts
        self.cache: OrderedDict[str, JudgeScore] = OrderedDict()
        self.num_requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._limit = asyncio.Semaphore(max_concurrency)
        self._in_flight: dict[str, asyncio.Task[JudgeScore]] = {}

    async def score(self, prompt: str, answer: str, *, reference: str | None = None) -> JudgeScore:
        """The verdict on one answer; concurrent calls for it share one request. Raises JudgeError."""
        key = _key(prompt, answer, reference)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a Judge outlives event loops (eval runs its own)
            self._loop = loop
            self._in_flight = {}
            self._limit = asyncio.Semaphore(self.max_concurrency)
        if key not in self._in_flight:
            call = self.rubric.request(prompt, answer, reference)
            self._in_flight[key] = loop.create_task(self._judge(key, call))
        # shielded: a caller that is cancelled leaves the request to the others waiting on it
        return await asyncio.shield(self._in_flight[key])

    async def reward(self, prompt: str, answer: str, *, reference: str | None = None) -> float:
        return (await self.score(prompt, answer, reference=reference)).reward

    async def _judge(self, key: str, call: JudgeCall) -> JudgeScore:
        try:
            async with self._limit:
                verdict = await self._ask(call)
        finally:
            self._in_flight.pop(key, None)
        self.cache[key] = verdict
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return verdict

    async def _ask(self, call: JudgeCall) -> JudgeScore:
        problem = ""
        for _ in range(self.max_attempts):
            self.num_requests += 1
            try:
                text = await self.backend(call.messages)
                scores = self.rubric.parse(text, nonce=call.nonce, quoted=call.quoted)
            except ValueError as e:  # an unreadable verdict: ask again
                problem = str(e)
                continue
            except Exception as e:
                raise JudgeError(f"judge failed: {type(e).__name__}: {e}") from e
            return JudgeScore(self.rubric.reward(scores), scores, text)
        raise JudgeError(f"judge gave no usable verdict in {self.max_attempts} attempts: {problem}")


def _key(prompt: str, answer: str, reference: str | None) -> str:
    parts = "\x00".join([prompt, answer, reference or ""])
    return hashlib.sha256(parts.encode()).hexdigest()


def judge(
    rubric: Rubric,
    *,
    url: str | None = None,
    model: str = "default",
    api_key: str | None = None,
    engine: Any = None,
    codec: Any = None,
    max_tokens: int = 256,
    **options: Any,
) -> Judge:
    """A Judge for `rubric`, through an OpenAI-compatible `url` (with `model`, `api_key`) or an
    agentrl `engine` (with its `codec`). `options` are Judge's (max_concurrency, ...)."""
    if (url is None) == (engine is None):
        raise ValueError("judge(rubric, ...): give url=... (OpenAI-compatible) or engine=..., one")
    if engine is not None:
        if codec is None:
            raise ValueError(
                "judge(rubric, engine=...): give codec=ChatCodec(...) for its template"
            )
        return Judge(rubric, engine_backend(engine, codec, max_tokens=max_tokens), **options)
    assert url is not None
    if not url.startswith(("http://", "https://")):
        raise ValueError(
            f"judge url={url!r}: give an http(s):// base URL, e.g. http://127.0.0.1:30000/v1"
        )
    backend = openai_backend(url, model=model, api_key=api_key, max_tokens=max_tokens)
    return Judge(rubric, backend, **options)
