"""`LocalEngine`: the Engine protocol on an in-process transformers model.

An asyncio front end queues requests from many episodes; one worker thread runs the model with
continuous batching (requests join and leave the running batch between decode steps).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from agentrl.engine.base import Completion, EngineError, FinishReason, SamplingParams
from agentrl.engine.batching import DecodeBatch, Sequence, StopChecker, decode_step, prefill
from agentrl.engine.model_store import load_model_and_tokenizer, resolve_device, resolve_model_path
from agentrl.engine.sampling import RowSampling, sample_next

if TYPE_CHECKING:
    from agentrl.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters kept by the worker; `max_running_batch_size` shows that requests were batched."""

    num_prefill_calls: int = 0
    num_decode_steps: int = 0
    num_generated_tokens: int = 0
    max_running_batch_size: int = 0


@dataclass
class _Command:
    """Work run on the worker thread between decode steps (weight updates, abort, memory moves)."""

    fn: Callable[[], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any) -> None:
    def set_once() -> None:
        if future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(set_once)
    except RuntimeError:  # the awaiting event loop has closed; nobody is waiting any more
        pass


class LocalEngine:
    """Serves many concurrent `generate` calls from one transformers model, batched together.

    Loads the model in the constructor (the engine is unusable without it) and starts the worker.
    """

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_batch_size: int = 32,
        seed: int = 0,
        weight_version: str = "0",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be at least 1")
        self.model_path = resolve_model_path(model_path)
        self.device = resolve_device(device)
        self.model, self.tokenizer = load_model_and_tokenizer(
            self.model_path, device=self.device, dtype=dtype
        )
        self.max_batch_size = max_batch_size
        self.stats = EngineStats()
        self._weight_version = weight_version
        self._generator = torch.Generator(self.device).manual_seed(seed)
        self._stop_checker = StopChecker(
            self.tokenizer, self._eos_token_ids(), self._max_positions()
        )
        self._pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self._pending: collections.deque[Sequence] = collections.deque()
        self._commands: collections.deque[_Command] = collections.deque()
        self._batch: DecodeBatch | None = None
        self._is_released = False
        self._is_closed = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentrl-local-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, model_cfg: ModelConfig, engine_cfg: EngineConfig) -> LocalEngine:
        path = resolve_model_path(model_cfg.path, model_cfg.cache_dir)
        return cls(
            path,
            device=model_cfg.device,
            dtype=model_cfg.dtype,
            max_batch_size=engine_cfg.max_batch_size,
        )

    def _eos_token_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids |= set(eos) if isinstance(eos, list) else {eos}
        return {i for i in ids if i is not None}

    def _max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", None) or 1 << 30)

    # ------------------------------------------------------------------ public API

    @property
    def weight_version(self) -> str:
        return self._weight_version

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, routing_key: str | None = None
    ) -> Completion:
        """Continue `input_ids`; the returned ids exclude the prompt. `routing_key` is unused here."""
        if self._is_closed:
            raise EngineError("LocalEngine is closed; create a new engine")
        self._check_request(input_ids, sampling)
        loop = asyncio.get_running_loop()
        seq = Sequence(
            list(input_ids), sampling, loop.create_future(), loop, self._row_sampling(sampling)
        )
        if sampling.max_new_tokens == 0 or len(input_ids) >= self._stop_checker.max_positions:
            seq.finish(FinishReason.LENGTH)
            return seq.to_completion(self._weight_version)
        self._pending.append(seq)
        self._wake.set()
        try:
            return await seq.future
        except asyncio.CancelledError:
            seq.is_cancelled = True  # the worker drops it at the next step
            self._wake.set()
            raise

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, weight_version: str
    ) -> None:
        """Copy HF-named tensors into the model in place, between decode steps."""
        updates = list(named_tensors)
        self._check_weights(updates)
        await self._call(lambda: self._apply_weights(updates, weight_version))

    async def release_memory(self) -> None:
        """Move weights and KV cache to host memory; generation pauses until `resume_memory`.

        A no-op on CPU, where there is no accelerator memory to give back.
        """
        if self.device != "cpu":
            await self._call(lambda: self._move_to("cpu", is_released=True))

    async def resume_memory(self) -> None:
        if self.device != "cpu":
            await self._call(lambda: self._move_to(self.device, is_released=False))

    async def abort(self) -> None:
        """End every running and queued request now; each returns its ids so far with ABORT."""
        await self._call(self._abort_all)

    async def health(self) -> bool:
        return self._thread.is_alive() and not self._is_closed

    async def close(self) -> None:
        """Stop the worker; requests still waiting fail with EngineError."""
        if self._is_closed:
            return
        self._is_closed = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        self._fail_all(EngineError("LocalEngine was closed while the request was running"))

    # ------------------------------------------------------------------ request checks

    def _check_request(self, input_ids: list[int], sampling: SamplingParams) -> None:
        if not input_ids:
            raise ValueError("input_ids is empty; pass at least one prompt token")
        bad = [i for i in input_ids if not 0 <= i < self._vocab_size]
        if bad:
            raise ValueError(
                f"input_ids hold {bad[:5]} outside the vocabulary [0, {self._vocab_size})"
            )
        if sampling.temperature < 0:
            raise ValueError(
                f"sampling.temperature={sampling.temperature} must be >= 0 (0 = greedy)"
            )
        if not 0 < sampling.top_p <= 1:
            raise ValueError(f"sampling.top_p={sampling.top_p} must be in (0, 1]")
        if sampling.top_k == 0 or sampling.top_k < -1:
            raise ValueError(f"sampling.top_k={sampling.top_k} must be -1 (off) or >= 1")
        if sampling.max_new_tokens < 0:
            raise ValueError(f"sampling.max_new_tokens={sampling.max_new_tokens} must be >= 0")

    def _row_sampling(self, sampling: SamplingParams) -> RowSampling:
        generator = None
        if sampling.seed is not None:
            # Its own RNG: the draws of a seeded request do not depend on its batch mates.
            generator = torch.Generator(self.device).manual_seed(sampling.seed)
        return RowSampling(sampling.temperature, sampling.top_p, sampling.top_k, generator)

    def _check_weights(self, updates: list[tuple[str, torch.Tensor]]) -> None:
        state = self.model.state_dict()
        for name, tensor in updates:
            if name not in state:
                raise ValueError(
                    f"update_weights: {name!r} is not a parameter of {self.model_path}; "
                    f"names are HF state-dict names such as {next(iter(state))!r}"
                )
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(state[name].shape)}"
                )

    # ------------------------------------------------------------------ worker-side commands

    async def _call(self, fn: Callable[[], Any]) -> Any:
        if self._is_closed:
            raise EngineError("LocalEngine is closed; create a new engine")
        loop = asyncio.get_running_loop()
        command = _Command(fn, loop.create_future(), loop)
        self._commands.append(command)
        self._wake.set()
        return await command.future

    def _apply_weights(self, updates: list[tuple[str, torch.Tensor]], weight_version: str) -> None:
        state = self.model.state_dict()  # fresh: `.to()` may have swapped parameter storage
        with torch.no_grad():
            for name, tensor in updates:
                target = state[name]
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        self._weight_version = weight_version

    def _move_to(self, device: str, *, is_released: bool) -> None:
        self.model.to(device)
        if self._batch is not None:
            self._batch.to(device)
        if is_released and torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._is_released = is_released

    def _abort_all(self) -> None:
        running = self._batch.sequences if self._batch is not None else []
        self._batch = None
        for seq in running + self._take_pending(len(self._pending)):
            seq.finish(FinishReason.ABORT)
            self._deliver(seq)

    def _fail_all(self, error: Exception) -> None:
        running = self._batch.sequences if self._batch is not None else []
        self._batch = None
        for seq in running + self._take_pending(len(self._pending)):
            _resolve(seq.loop, seq.future, error)
        while self._commands:
            command = self._commands.popleft()
            _resolve(command.loop, command.future, error)

    # ------------------------------------------------------------------ worker loop

    def _run(self) -> None:
        while not self._is_closed:
            self._wake.clear()
            self._run_commands()
            if self._is_released or not (self._pending or self._batch):
                self._wake.wait()
                continue
            try:
                self._step()
            except Exception as e:  # a failed forward must not kill the worker or hang callers
                logger.exception("LocalEngine step failed; failing the running requests")
                self._fail_running(EngineError(f"LocalEngine forward failed: {e!r}"))

    def _run_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            try:
                _resolve(command.loop, command.future, command.fn())
            except Exception as e:
                _resolve(command.loop, command.future, e)

    def _step(self) -> None:
        """Admit waiting requests (prefill), then one decode step for every running row."""
        self._drop_cancelled()
        room = self.max_batch_size - (len(self._batch) if self._batch else 0)
        admitted = [s for s in self._take_pending(room) if not s.is_cancelled]
        if admitted:
            self._admit(admitted)
        if self._batch is not None:
            self.stats.max_running_batch_size = max(
                self.stats.max_running_batch_size, len(self._batch)
            )
            logits = decode_step(self.model, self._batch)
            self.stats.num_decode_steps += 1
            self._sample_into(self._batch, logits)
            self._retire_finished()

    def _take_pending(self, n: int) -> list[Sequence]:
        taken = []
        while self._pending and len(taken) < n:
            taken.append(self._pending.popleft())
        return taken

    def _admit(self, sequences: list[Sequence]) -> None:
        try:
            joined, logits = prefill(self.model, sequences, self._pad_id)
            self.stats.num_prefill_calls += 1
            self._sample_into(joined, logits)
        except Exception as e:
            for seq in sequences:
                _resolve(seq.loop, seq.future, EngineError(f"LocalEngine prefill failed: {e!r}"))
            raise
        if self._batch is None:
            self._batch = joined
        else:
            self._batch.merge(joined)
        self._retire_finished()

    def _sample_into(self, batch: DecodeBatch, logits: torch.Tensor) -> None:
        ids, logprobs = sample_next(logits, [s.row for s in batch.sequences], self._generator)
        batch.next_input_ids = torch.tensor(ids, device=batch.next_input_ids.device)
        for seq, token_id, logprob in zip(batch.sequences, ids, logprobs, strict=True):
            seq.output_ids.append(token_id)
            seq.output_logprobs.append(logprob)
            self._stop_checker.check(seq)
        self.stats.num_generated_tokens += len(ids)

    def _retire_finished(self) -> None:
        assert self._batch is not None
        keep = [
            i
            for i, s in enumerate(self._batch.sequences)
            if not s.is_finished and not s.is_cancelled
        ]
        for seq in self._batch.sequences:
            if seq.is_finished:
                self._deliver(seq)
        if len(keep) == len(self._batch):
            return
        if keep:
            self._batch.keep(keep)
        else:
            self._batch = None

    def _drop_cancelled(self) -> None:
        if self._batch is not None and any(s.is_cancelled for s in self._batch.sequences):
            self._retire_finished()

    def _deliver(self, seq: Sequence) -> None:
        _resolve(seq.loop, seq.future, seq.to_completion(self._weight_version))

    def _fail_running(self, error: Exception) -> None:
        running = self._batch.sequences if self._batch is not None else []
        self._batch = None
        for seq in running:
            _resolve(seq.loop, seq.future, error)
