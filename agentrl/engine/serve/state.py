"""`ServerState`: what one `agentrl serve` app tracks around its engine (requests in flight, the
pause gate, released memory tags, weight update groups) and how a request honours pause and abort."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agentrl.engine.base import Completion, Engine, FinishReason, SamplingParams
from agentrl.engine.serve.requests import ServerLimits, engine_context_len

T = TypeVar("T")


class ClientDisconnectedError(Exception):
    """The HTTP client went away; its generation was aborted."""


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Any
    model_path: str
    served_model_name: str
    is_running: asyncio.Event = field(default_factory=asyncio.Event)  # cleared by pause_generation
    requests: dict[str, asyncio.Future[Completion]] = field(default_factory=dict)
    waiters: set[asyncio.Future[Any]] = field(
        default_factory=set
    )  # requests held by pause_generation
    released_tags: set[str] = field(default_factory=set)
    groups: dict[str, Any] = field(default_factory=dict)
    weight_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    limits: ServerLimits = field(default_factory=ServerLimits)
    # Rendezvous of /init_weights_update_group block for up to `limits.group_timeout_s` each:
    # their own threads, so parked ones never hold the pool that tokenizes and loads weights.
    group_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="agentrl-weight-group")
    )

    def __post_init__(self) -> None:
        self.is_running.set()
        self.context_len = engine_context_len(self.engine, self.tokenizer, self.limits.context_len)

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return (
            self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            if self.tokenizer
            else ""
        )

    async def run(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str,
        *,
        routing_key: str | None = None,
    ) -> Completion:
        """One generation, honouring pause and abort. The whole request (its wait while paused, then
        the engine call) is one task under `rid`, so `abort_request {rid}` can end it anywhere."""
        if "weights" in self.released_tags:
            raise ValueError(
                "weights are released (release_memory_occupation); call /resume_memory_occupation first"
            )
        request = asyncio.ensure_future(self._wait_then_generate(input_ids, sampling, routing_key))
        self.requests[rid] = request
        try:
            return await asyncio.shield(request)
        except asyncio.CancelledError:
            if not request.cancelled():  # the HTTP client went away
                request.cancel()
                raise
            return Completion([], [], FinishReason.ABORT, self.weight_version)
        finally:
            self.requests.pop(rid, None)

    async def _wait_then_generate(
        self, input_ids: list[int], sampling: SamplingParams, routing_key: str | None
    ) -> Completion:
        waiter = asyncio.ensure_future(self.is_running.wait())
        self.waiters.add(waiter)
        try:
            await waiter  # cancelled by abort_all: the request task ends cancelled -> ABORT
        finally:
            self.waiters.discard(waiter)
        return await self.engine.generate(input_ids, sampling, routing_key=routing_key)

    @property
    def num_waiting(self) -> int:
        return len(self.waiters)

    @property
    def num_running(self) -> int:
        return len(self.requests) - self.num_waiting

    async def abort_all(self) -> None:
        """Running requests return ABORT with their ids so far (the engine ends them); requests
        still waiting behind pause_generation return ABORT at once."""
        for waiter in list(self.waiters):
            waiter.cancel()
        await self.engine.abort()

    async def update_weights(
        self, named_tensors: list[tuple[str, Any]], weight_version: str | None
    ) -> None:
        async with self.weight_lock:
            await self.engine.update_weights(
                named_tensors, weight_version=weight_version or self.weight_version
            )


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
        await asyncio.gather(
            task, return_exceptions=True
        )  # the engine has ended it when this returns
        raise ClientDisconnectedError
    return task.result()
