"""The request half of the stand-in for SGLang's scheduler: what `TokenizerManager` does with
`/generate`, `/abort_request`, `/pause_generation`, `/continue_generation`, `/flush_cache` and
`/v1/loads`, answered as SGLang 0.5.23's scheduler answers (managers/scheduler.py,
scheduler_components/flush_wrapper.py) -- deterministic fake tokens in place of a model.

A request is admitted (running), advances one token per step, and finishes on `max_new_tokens`
(length) or a stop token id (stop). `hold` freezes every step so a test can look at requests in
flight without timing anything; `pause_generation` acts as SGLang's modes do."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

VOCAB_SIZE = 1000


def fake_token(position_key: int, step: int) -> int:
    """The token a request samples at `step`: a pure function of its prompt and the step."""
    return (position_key * 31 + step * 17 + 5) % VOCAB_SIZE


def fake_logprob(token_id: int) -> float:
    return -((token_id % 13) + 1) / 8.0


@dataclass
class Request:
    """One admitted request, as the scheduler holds it."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    stop_token_ids: set[int]
    return_logprob: bool
    cached_tokens: int
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    num_retractions: int = 0
    is_retracted: bool = False  # back in the waiting queue (pause mode "retract")
    done: asyncio.Event = field(default_factory=asyncio.Event)
    started_at: float = field(default_factory=time.monotonic)


class RequestStandIn:
    """Mixed into `StandInTokenizerManager`; holds the request state of one server."""

    def _init_requests(self, sglang: Any) -> None:
        from sglang.srt.utils.aio_rwlock import RWLock

        self._io = sglang.srt.managers.io_struct
        self.rid_to_state: dict[str, Request] = {}
        self.is_pause = False
        self.pause_mode: str | None = None
        self.is_pause_cond = asyncio.Condition()
        self.model_update_lock = RWLock()
        self.is_held = False
        self._step_cond = asyncio.Condition()
        self.prefix_cache: list[list[int]] = []
        self.last_receive_tstamp = time.time()

    # -- the scheduler's state

    def running(self) -> list[Request]:
        return [r for r in self.rid_to_state.values() if not r.is_retracted]

    def waiting(self) -> list[Request]:
        return [r for r in self.rid_to_state.values() if r.is_retracted]

    def is_fully_idle(self, *, ignore_waiting: bool = False) -> bool:
        """Scheduler.is_fully_idle: nothing running, nothing queued (queued ignored while the
        engine is paused, which is how a retract pause lets the cache be flushed)."""
        return not self.running() and (ignore_waiting or not self.waiting())

    def _cached_prefix(self, input_ids: list[int]) -> int:
        """Radix-cache hit: the longest stored prefix of `input_ids`, at most all but the last
        token (the scheduler always computes one)."""
        best = 0
        for seq in self.prefix_cache:
            n = 0
            for a, b in zip(seq, input_ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, max(len(input_ids) - 1, 0))

    def reset_prefix_cache(self) -> None:
        self.prefix_cache.clear()

    # -- generation

    async def generate_request(self, obj: Any, request: Any = None):
        """TokenizerManager.generate_request for one `input_ids` request (what agentrl sends)."""
        obj.normalize_batch_and_arguments()
        if obj.input_ids is None or not obj.is_single:
            raise ValueError("the stand-in serves single requests with input_ids only")
        if obj.rid in self.rid_to_state:
            raise ValueError(f"Duplicate request ID detected: {obj.rid}")
        params = self._sampling_params(obj.sampling_params or {})
        self.check_lora_path(obj.lora_path)  # type: ignore[attr-defined]  # LoraStandIn's
        async with self.is_pause_cond:  # paused: new requests wait in the tokenizer manager
            await self.is_pause_cond.wait_for(lambda: not self.is_pause)
        async with self.model_update_lock.reader_lock:
            req = Request(
                rid=str(obj.rid),
                input_ids=list(obj.input_ids),
                max_new_tokens=params.max_new_tokens or 128,
                stop_token_ids=set(params.stop_token_ids or ()),
                return_logprob=bool(obj.return_logprob),
                cached_tokens=self._cached_prefix(list(obj.input_ids)),
            )
            self.rid_to_state[req.rid] = req
            try:
                await self._decode(req)
            finally:
                self.rid_to_state.pop(req.rid, None)
        self.last_receive_tstamp = time.time()
        yield self._response(req)

    def _sampling_params(self, raw: dict[str, Any]) -> Any:
        """SGLang's own SamplingParams: unknown keys and bad values fail as they do there."""
        from sglang.srt.sampling.sampling_params import SamplingParams

        try:
            params = SamplingParams(**raw)
        except TypeError as e:
            raise ValueError(str(e)) from e
        params.verify(VOCAB_SIZE)
        return params

    async def _decode(self, req: Request) -> None:
        key = sum(req.input_ids) + len(req.input_ids)
        while req.finish_reason is None:
            async with self._step_cond:
                await self._step_cond.wait_for(lambda: self._can_step(req))
            if req.finish_reason is not None:  # aborted while waiting for its step
                break
            token = fake_token(key, len(req.output_ids))
            req.output_ids.append(token)
            if token in req.stop_token_ids:
                req.finish_reason = {"type": "stop", "matched": token}
            elif len(req.output_ids) >= req.max_new_tokens:
                req.finish_reason = {"type": "length", "length": req.max_new_tokens}
            await asyncio.sleep(0)  # one step per loop turn: other requests and routes run
        if req.finish_reason["type"] != "abort":
            self.prefix_cache.append(req.input_ids + req.output_ids)

    def _can_step(self, req: Request) -> bool:
        if req.finish_reason is not None:
            return True
        return not self.is_held and not req.is_retracted and self.pause_mode != "in_place"

    async def _wake(self) -> None:
        async with self._step_cond:
            self._step_cond.notify_all()

    def _response(self, req: Request) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "num_retractions": req.num_retractions,
            "weight_version": self.weight_version,
            "e2e_latency": time.monotonic() - req.started_at,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[fake_logprob(t), t, None] for t in req.output_ids]
            meta["input_token_logprobs"] = []
        return {"text": "", "output_ids": list(req.output_ids), "meta_info": meta}

    def create_abort_task(self, obj: Any) -> None:
        return None  # streaming is not what the suite is about

    # -- control

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """The scheduler aborts running and queued requests whose rid starts with `rid`."""
        if not abort_all and not rid:
            return
        for req in list(self.rid_to_state.values()):
            if abort_all or req.rid.startswith(rid):
                req.finish_reason = {
                    "type": "abort",
                    "message": "Abort in waiting queue" if req.is_retracted else "Abort request",
                    "status_code": 400,
                }
        with contextlib.suppress(RuntimeError):  # no running loop: nothing waits to be woken
            asyncio.get_running_loop().create_task(self._wake())

    async def pause_generation(self, obj: Any) -> None:
        mode = getattr(obj, "mode", "abort")
        async with self.is_pause_cond:
            self.is_pause = True
            self.pause_mode = mode
            if mode == "retract":  # running requests go back to the queue with their tokens
                for req in self.running():
                    req.is_retracted = True
                    req.num_retractions += 1
            elif mode == "abort":  # abort until nothing holds the model-update lock
                while await self.model_update_lock.is_locked():
                    self.abort_request(abort_all=True)
                    await asyncio.sleep(0.01)

    async def continue_generation(self, obj: Any) -> None:
        async with self.is_pause_cond:
            self.is_pause = False
            self.pause_mode = None
            for req in self.waiting():
                req.is_retracted = False
            self.is_pause_cond.notify_all()
        await self._wake()

    async def flush_cache(self, timeout_s: float = 0.0) -> Any:
        """Scheduler.flush_cache: refused while requests run or wait (waiting ones do not count
        while the engine is paused)."""
        if not self.is_fully_idle(ignore_waiting=self.is_pause):
            return self._io.FlushCacheReqOutput(success=False)
        self.reset_prefix_cache()
        return self._io.FlushCacheReqOutput(success=True)

    async def set_hold(self, is_held: bool) -> None:
        self.is_held = is_held
        await self._wake()

    async def get_loads(self, include: Any = None, dp_rank: Any = None) -> list[Any]:
        num_running, num_waiting = len(self.running()), len(self.waiting())
        try:
            from sglang.srt.managers.load_snapshot import LoadSnapshot

            return [LoadSnapshot(num_running_reqs=num_running, num_waiting_reqs=num_waiting)]
        except ImportError:  # SGLang before 0.5.2x: the io_struct output
            return [
                self._io.GetLoadsReqOutput(
                    dp_rank=0,
                    timestamp=time.time(),
                    num_running_reqs=num_running,
                    num_waiting_reqs=num_waiting,
                    num_used_tokens=0,
                    max_total_num_tokens=1 << 16,
                    token_usage=0.0,
                    gen_throughput=0.0,
                    cache_hit_rate=0.0,
                    utilization=0.0,
                    max_running_requests=256,
                )
            ]
