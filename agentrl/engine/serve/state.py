"""`ServerState`: what one `agentrl serve` app tracks around its engine (requests in flight, the
pause gate, released memory tags, weight update groups) and how a request honours pause and abort."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request

from agentrl.engine.base import Completion, Engine, FinishReason, SamplingParams
from agentrl.engine.serve.requests import ServerLimits, engine_context_len
from agentrl.engine.sglang.protocol import version_from_wire

T = TypeVar("T")

ToolParser = Callable[[list[int], list[dict[str, Any]]], Any]
"""Sampled ids and the request's tools -> an assistant `Message` (content + tool calls): the
run's ChatCodec.parse, passed in by whoever built the codec (the engine layer has none)."""


@dataclass
class Generation:
    """A request's completion across its engine calls (more than one when it was retracted) and
    SGLang's `weight_versions`: which weight version sampled which output tokens."""

    completion: Completion
    weight_versions: list[dict[str, Any]]

    def add(self, part: Completion, *, prompt_tokens: int) -> None:
        c = self.completion
        start = len(self.completion.ids)
        if start == 0:
            c.cached_tokens = part.cached_tokens
        c.ids, c.logprobs = c.ids + part.ids, c.logprobs + part.logprobs
        c.finish_reason = part.finish_reason
        c.matched_stop = part.matched_stop
        c.weight_version = part.weight_version
        c.prompt_tokens = prompt_tokens
        for version, num_tokens in part.version_spans or [(part.weight_version, len(part.ids))]:
            self._add_span(str(version), num_tokens)  # SGLang's wire form: a string

    def _add_span(self, version: str, num_tokens: int) -> None:
        spans = self.weight_versions
        end = (spans[-1]["end"] if spans else 0) + num_tokens
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = end
        elif num_tokens or not spans:
            spans.append({"version": version, "start": end - num_tokens, "end": end})


class ClientDisconnectedError(Exception):
    """The HTTP client went away; its generation was aborted."""


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Any
    model_path: str
    served_model_name: str
    is_running: asyncio.Event = field(default_factory=asyncio.Event)  # cleared by pause_generation
    requests: dict[str, asyncio.Future[Any]] = field(default_factory=dict)
    # requests held by pause_generation
    waiters: set[asyncio.Future[Any]] = field(default_factory=set)
    ended_waiters: set[asyncio.Future[Any]] = field(default_factory=set)  # by abort_all
    released_tags: set[str] = field(default_factory=set)
    groups: dict[str, Any] = field(default_factory=dict)
    weight_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    limits: ServerLimits = field(default_factory=ServerLimits)
    tool_parser: ToolParser | None = None  # chat replies to requests with tools: `tool_calls`
    # Rendezvous of /init_weights_update_group block for up to `limits.group_timeout_s` each:
    # their own threads, so parked ones never hold the pool that tokenizes and loads weights.
    group_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="agentrl-weight-group")
    )

    retract_epoch: int = 0  # counts retracting pauses
    abort_epoch: int = 0  # counts abort_all calls
    weight_session: bool = False  # between /begin_weight_update and /end_weight_update
    lora_names: set[str] = field(default_factory=set)  # LoRA adapters loaded, not unloaded
    # this server's own seconds of the last weight update (since its session began), by phase:
    # receive (unpickle, broadcast or disk read) and load (into the engine); no HTTP in them
    last_weight_update_s: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.is_running.set()
        self.context_len = engine_context_len(self.engine, self.tokenizer, self.limits.context_len)

    def add_weight_update_time(self, **seconds: float) -> None:
        for phase, value in seconds.items():
            self.last_weight_update_s[phase] = self.last_weight_update_s.get(phase, 0.0) + value

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        if not self.tokenizer:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str,
        *,
        routing_key: str | None = None,
    ) -> Generation:
        """One generation, honouring pause, retraction and abort. The whole request (its waits
        while paused, then the engine calls) is one task under `rid`, so `abort_request {rid}`
        can end it anywhere."""
        if "weights" in self.released_tags:
            raise ValueError(
                "weights are released (release_memory_occupation); call /resume_memory_occupation first"
            )
        gen = Generation(Completion([], [], FinishReason.ABORT, self.weight_version), [])
        request = asyncio.ensure_future(self._generate(gen, input_ids, sampling, routing_key))
        self.requests[rid] = request
        try:
            return await asyncio.shield(request)
        except asyncio.CancelledError:
            if not request.cancelled():  # the HTTP client went away
                request.cancel()
                raise
            gen.completion.finish_reason = FinishReason.ABORT  # ended by abort_request
            return gen
        finally:
            self.requests.pop(rid, None)

    async def _generate(
        self, gen: Generation, input_ids: list[int], sampling: SamplingParams, key: str | None
    ) -> Generation:
        """Engine calls until one is not retracted: a request retracted by
        `pause_generation {mode: retract}` waits for `continue_generation`, then goes on from the
        prompt plus its output so far (recomputed on the weights of then, as SGLang does)."""
        while True:
            if not await self._wait_running():
                return gen  # aborted while held: its output so far, ABORT
            epochs = (self.retract_epoch, self.abort_epoch)
            budget = sampling.max_new_tokens - len(gen.completion.ids)
            part = await self.engine.generate(
                input_ids + gen.completion.ids,
                dataclasses.replace(sampling, max_new_tokens=budget),
                routing_key=key,
            )
            gen.add(part, prompt_tokens=len(input_ids))
            retracted = self.retract_epoch != epochs[0] and self.abort_epoch == epochs[1]
            if (
                part.finish_reason is not FinishReason.ABORT
                or not retracted
                or budget <= len(part.ids)
            ):
                return gen

    async def _wait_running(self) -> bool:
        """Wait while generation is paused; False when abort_all ended the wait."""
        waiter = asyncio.ensure_future(self.is_running.wait())
        self.waiters.add(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter not in self.ended_waiters:  # the request itself is being cancelled
                raise
            return False
        finally:
            self.waiters.discard(waiter)
            self.ended_waiters.discard(waiter)
        return True

    async def pause(self, mode: str) -> None:
        """SGLang's modes: `abort` ends every request; `retract` (and `in_place`, which this
        engine cannot hold mid-batch) sends running requests back to wait for `continue`."""
        self.is_running.clear()  # new requests wait
        if mode == "abort":
            await self.abort_all()
        else:
            self.retract_epoch += 1
            await self.engine.abort()  # each returns its ids so far; `_generate` holds it

    @property
    def num_waiting(self) -> int:
        return len(self.waiters)

    @property
    def num_running(self) -> int:
        return len(self.requests) - self.num_waiting

    async def abort_all(self) -> None:
        """Running requests return ABORT with their ids so far (the engine ends them); requests
        still waiting behind pause_generation return ABORT at once."""
        self.abort_epoch += 1
        for waiter in list(self.waiters):
            self.ended_waiters.add(waiter)
            waiter.cancel()
        await self.engine.abort()

    async def update_weights(
        self, named_tensors: list[tuple[str, Any]], weight_version: str | None
    ) -> None:
        """`weight_version`: the request's string (SGLang's wire form); None keeps the served one."""
        version = version_from_wire(weight_version) if weight_version else self.weight_version
        async with self.weight_lock:
            await self.engine.update_weights(named_tensors, weight_version=version)


async def cancel_on_disconnect(request: Any, work: asyncio.Future[T] | Any) -> T:
    """Await `work`, cancelling it if the client disconnects first: Starlette does not cancel a
    non-streaming handler, so without this a client that gave up leaves its generation running.
    The body is read by then, so the next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # the engine has ended it by then
        raise ClientDisconnectedError
    return task.result()


def server_state(request: Request) -> ServerState:
    """The routes' dependency: the app's `ServerState` (`create_app` made it)."""
    return request.app.state.sglang


State = Annotated[ServerState, Depends(server_state)]
"""A route's parameter `s: State` receives the server's state."""
