"""`LocalEngine`: the Engine protocol on an in-process transformers model.

An asyncio front end queues requests from many episodes; one worker thread runs the model with
continuous batching: each step packs every running sequence's uncached tokens (prefill, continued
prefill, decode) into one forward whose attention reads and writes a fixed KV arena. On CUDA, steps
that only decode replay a CUDA graph; an episode's routing key keeps its slot between turns.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from agentrl.engine.base import Completion, EngineError, FinishReason, SamplingParams
from agentrl.engine.local.attention import (
    flash_attention_supported,
    forward_over_arena,
    split_k_supported,
    use_arena_attention,
)
from agentrl.engine.local.batching import Sequence, StopChecker
from agentrl.engine.local.cpu_linear import PackedLinears
from agentrl.engine.local.engine_memory import EngineMemory
from agentrl.engine.local.fused_model import FusedDecoder, unsupported_reason
from agentrl.engine.local.kv_arena import KVArena
from agentrl.engine.local.lora_merge import MergedAdapter
from agentrl.engine.local.scheduler import Scheduler
from agentrl.engine.local.stepper import EngineStats, StepOptions, Stepper
from agentrl.engine.local.worker import Command, check_request, resolve
from agentrl.model_store import eos_token_ids, load_model_and_tokenizer, resolve_model_path

if TYPE_CHECKING:
    from agentrl.config import EngineConfig, ModelConfig
    from agentrl.weights.adapter import AdapterExport

logger = logging.getLogger(__name__)

__all__ = ["EngineStats", "LocalEngine", "LocalEngineOptions"]


@dataclass(frozen=True)
class LocalEngineOptions:
    """How a `LocalEngine` batches, caches and runs its model (checked when built).

    - `max_batch_size`: most sequences decoded together.
    - `seed`: of the sampler's generator.
    - `max_context_len`: tokens (prompt + output) one sequence may reach; default the model's
      context, at most 8192. Longer prompts finish at once with LENGTH.
    - `num_slots`: sequences the KV arena holds (running, or idle for their next turn); default
      sized by `KVArena.for_model` from `mem_fraction_static` of the free memory on CUDA.
    - `mem_fraction_static`: of the free device memory, what the KV arena may take.
    - `max_prefill_tokens`: new tokens admitted into one step (a longer prompt still runs alone).
    - `use_prefix_cache`: keep a routing key's slot between turns and prefill only the new tail.
    - `use_cuda_graphs`: decode under CUDA graphs (CUDA in bf16/fp16 only; eager elsewhere).
    - `weights_cpu_backup`: False: `release_memory` drops the weights instead of copying them to
      the host (a colocated trainer sends them all again before the next request).
    - `pausable_memory`: on CUDA with `torch_memory_saver` installed, keep the weights and the KV
      arena in pausable regions: `release_memory` unmaps their pages and `resume_memory` maps
      fresh ones at the same addresses (fast; the arena keeps its size; graphs stay valid).
    - `pack_cpu_linears`: on an x86 CPU in fp32, run the linear layers through oneDNN on a
      prepacked copy of their weights (2-3x faster matmuls; one more copy of them in memory).
    - `fuse_projections`: run Llama-family models (Llama, Qwen2, Mistral) through the engine's own
      forward with one q/k/v and one gate/up product per layer (`fused_model.py`; the weights stay
      the model's parameters, viewed together). None: on CUDA only.
    - `compile_decode`: on CUDA, compile the fused forward's pieces and the sampler with
      `torch.compile` and capture the compiled kernels in the decode graphs (falls back to eager
      where compilation fails).
    - `split_k_decode`: on CUDA with triton, attend in decode steps through the split-K kernel of
      `decode_attention.py` instead of FlashAttention (which runs a 128-row query block for
      each decoding sequence's one query).
    """

    max_batch_size: int = 32
    seed: int = 0
    max_context_len: int | None = None
    num_slots: int | None = None
    mem_fraction_static: float = 0.5
    max_prefill_tokens: int = 8192
    use_prefix_cache: bool = True
    use_cuda_graphs: bool = True
    weights_cpu_backup: bool = True
    pausable_memory: bool = True
    pack_cpu_linears: bool = True
    fuse_projections: bool | None = None
    compile_decode: bool = True
    split_k_decode: bool = True

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size} must be at least 1")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1]")


class LocalEngine:
    """Serves many concurrent `generate` calls from one transformers model, batched together.

    The constructor sizes and allocates the KV arena and starts the worker; `load` reads a
    checkpoint first. How it batches and runs: `LocalEngineOptions`.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        options: LocalEngineOptions | None = None,
        *,
        model_path: str = "",
        weight_version: int = 0,
        reserve_bytes: int = 0,
    ) -> None:
        """An engine around a loaded transformers `model` (on its device) and its `tokenizer`;
        `LocalEngine.load` reads them from a checkpoint. `reserve_bytes`: left out of the free
        memory the KV arena is sized from (what a colocated trainer will still allocate)."""
        self.options = options = options or LocalEngineOptions()
        self.mem_fraction_static = options.mem_fraction_static
        self.reserve_bytes = reserve_bytes
        self.model_path = model_path
        self.model = model
        self.tokenizer = tokenizer
        self.device = str(next(model.parameters()).device)
        use_arena_attention(self.model)
        self._packed = PackedLinears.install(self.model) if options.pack_cpu_linears else None
        self.fused = self._fused_decoder(options.fuse_projections)
        self.max_batch_size = options.max_batch_size
        self.weights_cpu_backup = options.weights_cpu_backup
        self._weight_version = weight_version
        self._generator = torch.Generator().manual_seed(options.seed)
        self._size_arena = functools.partial(
            KVArena.for_model,
            self.model.config,
            self.model.dtype,
            self.device,
            max_batch_size=options.max_batch_size,
            max_context_len=min(options.max_context_len or 8192, self._max_positions()),
            num_slots=options.num_slots,
            mem_fraction=options.mem_fraction_static,
            reserve_bytes=reserve_bytes,
        )
        self.memory = EngineMemory(
            self.model,
            self.device,
            pausable=options.pausable_memory,
            weights_cpu_backup=options.weights_cpu_backup,
            mem_fraction_static=options.mem_fraction_static,
            groups=self.fused.groups if self.fused else (),
        )
        if self.fused is not None:
            self.fused.rebind()  # packing moved the parameters
        self.arena = self._size_arena()
        self.memory.allocate(self.arena)
        # On CPU the arena is address space: pages are committed as slots are written, so its
        # size may exceed the machine's memory (it said "24.5 GB" on a 23 GB machine).
        committed = (
            "reserved" if self.device.startswith("cuda") else "virtual, committed as written"
        )
        logger.info(
            "LocalEngine KV arena on %s: %d slots x %d tokens, %.1f GB %s (%.1f GiB kept for a trainer)",
            self.device,
            self.arena.num_slots,
            self.arena.max_len,
            self.arena.nbytes / 1e9,
            committed,
            reserve_bytes / 2**30,
        )
        self._scheduler = Scheduler(
            self.arena,
            max_batch_size=options.max_batch_size,
            max_prefill_tokens=options.max_prefill_tokens,
            use_prefix_cache=options.use_prefix_cache,
        )
        self._stop_checker = StopChecker(
            self.tokenizer,
            set(eos_token_ids(self.tokenizer, self.model.generation_config)),
            min(self._max_positions(), self.arena.max_len),
        )
        self._vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self._stepper = self._make_stepper(
            options.use_cuda_graphs, options.compile_decode, options.split_k_decode
        )
        self.stats: EngineStats = self._stepper.stats
        # HF name -> the Parameter (or buffer) itself; release and resume swap `.data`, never the
        # objects, so the map stays valid (a state_dict() per weight update costs milliseconds).
        self._tensors: dict[str, torch.Tensor] = self.model.state_dict(keep_vars=True)
        self.adapter = MergedAdapter()  # the LoRA adapter merged into the weights, if any
        self._commands: collections.deque[Command] = collections.deque()
        self._is_closed = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentrl-local-engine", daemon=True)
        self._thread.start()

    def _fused_decoder(self, fuse: bool | None) -> FusedDecoder | None:
        if fuse is None:
            fuse = self.device.startswith("cuda") and unsupported_reason(self.model) is None
        if not fuse:
            return None
        if (reason := unsupported_reason(self.model)) is not None:
            raise ValueError(f"fuse_projections=True: {reason}; pass fuse_projections=False")
        return FusedDecoder(self.model)

    def _make_stepper(self, use_cuda_graphs: bool, compile_decode: bool, split_k: bool) -> Stepper:
        use_flash = flash_attention_supported(self.device, self.model.dtype)
        options = StepOptions(
            device=self.device,
            vocab_size=self._vocab_size,
            max_batch_size=self.max_batch_size,
            use_flash=use_flash,
            use_graphs=use_cuda_graphs and use_flash,
            compile_graphs=compile_decode and use_flash,
            split_k=split_k and use_flash and split_k_supported(self.device),
        )
        if self.fused is not None:
            forward = self.fused.forward
        else:
            forward = functools.partial(forward_over_arena, self.model)
        if self.fused is not None and options.compile_graphs:
            # Prefill compiled too, from the first step: decode graphs and prefill then run the
            # same kernels (a request's first prefill and later ones agree bit for bit).
            self.fused.set_compiled(True)
        return Stepper(
            self._scheduler,
            forward,
            options,
            self._stop_checker,
            deliver=self._deliver,
            has_commands=lambda: bool(self._commands),
            packed=self._packed,
            set_compiled=self.fused.set_compiled if self.fused is not None else None,
        )

    @classmethod
    def load(
        cls,
        model_path: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        reserve_bytes: int = 0,
        **options: Any,
    ) -> LocalEngine:
        """Load the checkpoint (or the bundled model's name) at `model_path` onto `device` and
        start an engine on it; `options`: the fields of `LocalEngineOptions`."""
        engine_options = LocalEngineOptions(**options)  # a misspelled option fails before loading
        path = resolve_model_path(model_path)
        model, tokenizer = load_model_and_tokenizer(path, device=device, dtype=dtype)
        return cls(model, tokenizer, engine_options, model_path=path, reserve_bytes=reserve_bytes)

    @classmethod
    def from_config(
        cls, model_cfg: ModelConfig, engine_cfg: EngineConfig, *, reserve_bytes: int = 0
    ) -> LocalEngine:
        path = resolve_model_path(model_cfg.path, model_cfg.cache_dir)
        return cls.load(
            path,
            device=model_cfg.device,
            dtype=model_cfg.dtype,
            max_batch_size=engine_cfg.max_batch_size,
            mem_fraction_static=engine_cfg.mem_fraction_static,
            reserve_bytes=reserve_bytes,
        )

    def _max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", None) or 1 << 30)

    # ------------------------------------------------------------------ public API

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def last_resume_s(self) -> dict[str, float]:
        """Seconds the last `resume_memory` took per tag, inside the engine."""
        return self.memory.last_resume_s

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, routing_key: str | None = None
    ) -> Completion:
        """Continue `input_ids`; the returned ids exclude the prompt. Requests sharing a
        `routing_key` (one episode's turns) reuse the K/V of their common prefix."""
        if self._is_closed:
            raise EngineError("LocalEngine is closed; create a new engine")
        dropped = self.memory.dropped
        if dropped is not None and "weights" not in self.memory.released:
            raise EngineError(
                f"{len(dropped.unsent)} weight tensors were dropped by release_memory("
                "keep_weights=False) and not sent again; call update_weights with every weight first"
            )
        check_request(input_ids, sampling, self._vocab_size)
        loop = asyncio.get_running_loop()
        seq = Sequence(
            list(input_ids),
            sampling,
            loop.create_future(),
            loop,
            seed=self._request_seed(sampling),
            routing_key=routing_key,
        )
        if sampling.max_new_tokens == 0 or len(input_ids) >= self._stop_checker.max_positions:
            seq.finish(FinishReason.LENGTH)
            return seq.to_completion(self._weight_version)
        self._scheduler.add(seq)
        self._wake.set()
        try:
            return await seq.future
        except asyncio.CancelledError:
            seq.is_cancelled = True  # the worker drops it at the next step
            self._wake.set()
            raise

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, weight_version: int
    ) -> None:
        """Copy HF-named tensors into the model in place, between steps (CUDA graphs stay valid).
        Idle multi-turn prefixes are dropped: their K/V came from the old weights."""
        updates = list(named_tensors)
        self._check_weights(updates)
        await self._call(lambda: self._apply_weights(updates, weight_version))

    async def load_lora_adapter(
        self, name: str, adapter: AdapterExport, *, weight_version: int
    ) -> None:
        """Merge `adapter` into the weights in place under `name`, replacing the one merged
        before (`MergedAdapter`); generation then serves it whatever `lora_path` a request names."""
        self.adapter.check(adapter, self._tensors)
        if self.memory.dropped is not None:
            raise ValueError(
                "load_lora_adapter: release_memory(keep_weights=False) dropped the base weights an "
                "adapter merges into; release with keep_weights=True (weights_cpu_backup)"
            )
        await self._call(lambda: self._merge_adapter(name, adapter, weight_version))

    async def unload_lora_adapter(self, name: str) -> None:
        """The base weights back, if `name` is the merged adapter (one replaced by a later load
        is gone already)."""
        if name == self.adapter.name:
            restored = self.adapter.unmerge
            await self._call(
                lambda: self._weights_written(restored(self._tensors), self._weight_version)
            )

    async def release_memory(self, *, keep_weights: bool | None = None) -> None:
        """Free the accelerator memory: weights move to host memory (or, with `keep_weights=False`,
        are dropped: the caller sends all of them before the next request, as a colocated trainer
        does), the KV arena and CUDA graphs are dropped. Running requests pause and are prefilled
        again after `resume_memory`.

        A no-op on CPU, where there is no accelerator memory to give back.
        """
        keep = self.weights_cpu_backup if keep_weights is None else keep_weights
        if self.device != "cpu":
            await self._call(lambda: self._release(keep))

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """Take memory back, by SGLang's tags: "weights" (back from the host, or fresh storage for
        dropped ones), "kv_cache" (a KV arena sized again from free memory); None = both. A
        colocated trainer resumes the weights, syncs, then the KV cache: the peak never holds the
        KV arena next to its weight buckets. Generation restarts once both are back; CUDA graphs
        are captured again at the next decode step."""
        wanted = {"weights", "kv_cache"} if tags is None else set(tags)
        if self.device != "cpu":
            await self._call(lambda: self._resume(wanted))

    @property
    def is_memory_pausable(self) -> bool:
        """Whether weights and KV arena live in pausable regions (CUDA with torch_memory_saver)."""
        return self.memory.is_pausable

    def device_memory_bytes(self) -> int:
        """Accelerator memory this engine holds (0 on CPU; paused regions not counted)."""
        return self.memory.held_bytes(self.arena)

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
        if self.memory.is_pausable:  # the pausable regions' pages go back to the device
            self._stepper.graphs = None
            if self.fused is not None:
                self.fused.unbind()
            self.memory.close(self.arena)

    # ------------------------------------------------------------------ request checks

    def _request_seed(self, sampling: SamplingParams) -> int:
        # A seeded request draws from its own noise stream: independent of its batch mates.
        if sampling.seed is not None:
            return sampling.seed & ((1 << 63) - 1)
        return int(torch.randint(0, 1 << 62, (1,), generator=self._generator))

    def _check_weights(self, updates: list[tuple[str, torch.Tensor]]) -> None:
        state = self._tensors
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
        command = Command(fn, loop.create_future(), loop)
        self._commands.append(command)
        self._wake.set()
        return await command.future

    def _apply_weights(self, updates: list[tuple[str, torch.Tensor]], weight_version: int) -> None:
        with torch.no_grad():
            for name, tensor in updates:
                target = self._tensors[name]
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        if updates:  # new base weights (a version stamp alone sends none): adapters merge into them
            self.adapter = MergedAdapter()
        self._weights_written([self._tensors[name] for name, _ in updates], weight_version)

    def _merge_adapter(self, name: str, adapter: AdapterExport, weight_version: int) -> None:
        self._weights_written(self.adapter.merge(name, adapter, self._tensors), weight_version)

    def _weights_written(self, tensors: list[torch.Tensor], weight_version: int) -> None:
        self.memory.weights_written(tensors)
        if weight_version != self._weight_version:
            self._continue_under(weight_version)
        self._scheduler.drop_prefixes()  # their K/V came from the old weights

    def _continue_under(self, weight_version: int) -> None:
        """Requests in flight go on under the new weights, their K/V computed again (as SGLang's
        retract does), so each later token is exactly the new version's; the tokens sampled so
        far keep the old version, or a stale token would pass as fresh (slime #2092)."""
        for seq in self._scheduler.running:
            seq.num_cached = 0
        for seq in [*self._scheduler.running, *self._scheduler.pending]:
            seq.close_span(self._weight_version)
        self._weight_version = weight_version

    def _release(self, keep_weights: bool) -> None:
        # Running requests are prefilled again on resume.
        self._scheduler.preempt_all(free_buffers=not self.memory.is_pausable)
        if not self.memory.is_pausable:
            self._stepper.graphs = None  # the weights and the arena move: captured again
            if self.fused is not None:  # the fused views would keep the old storage alive
                self.fused.unbind()
        self.memory.release(keep_weights)

    def _resume(self, tags: set[str]) -> None:
        self.arena = self._scheduler.arena = self.memory.resume(tags, self.arena, self._size_arena)
        if self.fused is not None and "weights" not in self.memory.released:
            self.fused.rebind()

    def _abort_all(self) -> None:
        for seq in self._scheduler.take_all(keep_prefixes=True):
            seq.finish(FinishReason.ABORT)
            self._deliver(seq)

    def _fail_all(self, error: Exception) -> None:
        for seq in self._scheduler.take_all(keep_prefixes=False):
            resolve(seq.loop, seq.future, error)
        while self._commands:
            command = self._commands.popleft()
            resolve(command.loop, command.future, error)

    # ------------------------------------------------------------------ worker loop

    def _run(self) -> None:
        if self.device.startswith("cuda"):  # graph capture and cuBLAS follow the current device
            torch.cuda.set_device(torch.device(self.device))
        while not self._is_closed:
            self._wake.clear()
            while self._commands and self._stepper.in_flight is not None:
                self._stepper.check_decode()  # launches nothing more while commands wait
            self._run_commands()
            # Dropped weights not yet sent again: nothing may run on them.
            if not self.memory.is_ready or not self._scheduler.has_work():
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
                resolve(command.loop, command.future, command.fn())
            except Exception as e:
                resolve(command.loop, command.future, e)

    def _step(self) -> None:
        self._stepper.step()

    def _deliver(self, seq: Sequence) -> None:
        resolve(seq.loop, seq.future, seq.to_completion(self._weight_version))

    def _fail_running(self, error: Exception) -> None:
        self._stepper.fail_running(error, lambda seq, e: resolve(seq.loop, seq.future, e))
