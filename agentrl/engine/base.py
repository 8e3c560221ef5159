"""The `Engine` protocol every inference backend implements, mirroring SGLang's native API."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


class FinishReason(str, enum.Enum):
    """SGLang's `meta_info.finish_reason.type`."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # aborted by the client or the server


@dataclass
class SamplingParams:
    """SGLang `sampling_params`; `-1` for top_k means off, temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    """Stop strings; the stop string stays in the output (SGLang `no_stop_trim=True`)."""
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    """Per-request seed (SGLang `sampling_seed`); None = engine RNG. SGLang honours it only on a
    server started with --enable-deterministic-inference; elsewhere it is ignored."""

    def to_sglang(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "no_stop_trim": True,
        }
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out


@dataclass
class Completion:
    """What one generate call returns: the sampled ids and their logprobs, verbatim."""

    ids: list[int]
    logprobs: list[float]  # one per id, log p(id | prefix) under the sampling distribution's model
    finish_reason: FinishReason
    weight_version: int
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    served_by: str = ""  # the server that sampled it (its base URL); "" in process
    is_logprob_truncated: bool = False
    """The logprobs are of the distribution sampled from, top-k/top-p applied and renormalised
    (the embedded engine); False: of the whole softmax at the temperature (SGLang)."""
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    """(weight version, output tokens it sampled), in order, when the request crossed a weight
    update (SGLang's `weight_versions`, after a retracting pause); empty: all by weight_version."""

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.logprobs):
            raise ValueError(
                f"Completion has {len(self.ids)} ids but {len(self.logprobs)} logprobs"
            )


class EngineError(RuntimeError):
    """The engine failed (5xx after retries, timeout, a bad request). Episodes end ERROR/engine."""


class EngineMemoryError(EngineError):
    """The device has no room for what the engine takes back on resume (its weights or KV cache
    after a colocated train step). The message says how much and what to lower."""


class EngineUnavailable(EngineError):
    """The server cannot be reached (it died or is restarting) or no longer serves the policy's
    weights (a restarted server). Not the episode's fault: it ends ABORTED/engine, is never scored
    or trained on, and the step runs its task again once the engine group is healed."""


@runtime_checkable
class Engine(Protocol):
    """An inference engine. All methods are async; one engine serves many concurrent episodes."""

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, routing_key: str | None = None
    ) -> Completion:
        """Continue `input_ids`; the returned ids exclude the prompt."""
        ...

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, weight_version: int
    ) -> None:
        """Load new weights (HF names); requests after this return `weight_version`."""
        ...

    async def release_memory(self) -> None:
        """Free accelerator memory (weights, KV cache) so a colocated trainer can use it."""
        ...

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """Take memory back: "weights", "kv_cache" (SGLang's tags), None = all."""
        ...

    async def abort(self) -> None:
        """Abort every running request; they return with finish_reason ABORT."""
        ...

    async def health(self) -> bool: ...

    async def close(self) -> None: ...

    @property
    def weight_version(self) -> int: ...
