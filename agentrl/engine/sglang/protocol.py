"""SGLang's native HTTP shapes on the client side: the `/generate` request body, `meta_info` ->
`Completion` (finish-reason mapping included), and request counts from `/v1/loads`."""

from __future__ import annotations

import os
import uuid
from typing import Any

from agentrl.engine.base import Completion, EngineError, FinishReason, SamplingParams

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""sglang-router (SGLang Model Gateway) reads this header for its `consistent_hashing` and
`manual` policies; slime sends the episode's session id in it."""

LOGPROB_TRUNCATED_KEY = "agentrl_logprob_truncated"
"""`meta_info` key of `agentrl serve` (absent from SGLang): true when the logprobs are of the
top-k/top-p truncated distribution the tokens were drawn from (`Completion.is_logprob_truncated`)."""

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's memory tags; a release or resume without tags means all of them."""

API_KEY_ENV = "AGENTRL_API_KEY"
"""Where the key of servers started with `--api-key` is read when no config names one (the same
variable `agentrl serve --api-key` reads)."""


def resolve_api_key(engine_cfg: Any) -> str | None:
    """`engine.api_key` when the config has the field and sets it, else AGENTRL_API_KEY."""
    return getattr(engine_cfg, "api_key", None) or os.environ.get(API_KEY_ENV) or None


# ---------------------------------------------------------------- request bodies


def generate_payload(
    input_ids: list[int], sampling: SamplingParams, *, lora_path: str | None = None
) -> dict[str, Any]:
    """A `/generate` body (io_struct.py GenerateReqInput) under a fresh `rid`, asking for the
    output tokens' logprobs (which carry the ids too: see `completion_from_sglang`), with the
    loaded LoRA adapter `lora_path` names, if any.

    `sampling.seed` goes as `sampling_seed`, which SGLang honours only on a server started with
    `--enable-deterministic-inference`; elsewhere it is ignored and sampling is not reproducible."""
    return {
        "rid": uuid.uuid4().hex,
        "input_ids": list(input_ids),
        "sampling_params": sampling.to_sglang(),
        "return_logprob": True,
        "logprob_start_len": -1,  # GenerateReqInput: -1 = logprobs of output tokens only
        **({"lora_path": lora_path} if lora_path else {}),
    }


# ---------------------------------------------------------------- response parsing


def completion_from_sglang(out: dict[str, Any]) -> Completion:
    """A `/generate` response -> Completion. Ids AND logprobs both come from
    `meta_info.output_token_logprobs` ([logprob, token_id, text] per sampled token), so they
    can never disagree with each other."""
    meta = out.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineError(f"/generate response has no meta_info: {str(out)[:300]}")
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise EngineError(
            "/generate response lacks meta_info.output_token_logprobs; send return_logprob=true"
        )
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    try:
        finish = FinishReason(kind)
    except ValueError:
        finish = FinishReason.ABORT  # unknown kinds (e.g. an error) must not be trained on
    return Completion(
        ids=[int(p[1]) for p in pairs],
        logprobs=[float(p[0]) for p in pairs],
        finish_reason=finish,
        weight_version=version_from_wire(meta.get("weight_version", "default")),
        matched_stop=reason.get("matched") if isinstance(reason, dict) else None,
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        is_logprob_truncated=bool(meta.get(LOGPROB_TRUNCATED_KEY, False)),
        version_spans=version_spans_from_sglang(meta.get("weight_versions"), len(pairs)),
    )


def version_from_wire(version: object) -> int:
    """SGLang's `weight_version` (a string on the wire) as agentrl's policy version, an int: the
    server's own "default", before any update, is 0, the weights it started with."""
    if version == "default":
        return 0
    try:
        return int(str(version))
    except ValueError:
        raise EngineError(
            f"weight_version={version!r} is not a policy version (0, 1, ...); let agentrl set "
            "it (start the server without --weight-version)"
        ) from None


def version_spans_from_sglang(spans: Any, num_tokens: int) -> list[tuple[int, int]]:
    """`meta_info.weight_versions` ([{version, start, end}] over the output tokens) -> (version,
    number of tokens) spans; empty when it names one version only, or is absent or malformed (the
    completion's `weight_version` then covers every token)."""
    if not isinstance(spans, list) or len(spans) < 2:
        return []
    try:
        out = [(version_from_wire(s["version"]), int(s["end"]) - int(s["start"])) for s in spans]
    except (KeyError, TypeError, ValueError, EngineError):
        return []
    return out if sum(n for _, n in out) == num_tokens else []


def aborted_completion(weight_version: int) -> Completion:
    return Completion(
        ids=[], logprobs=[], finish_reason=FinishReason.ABORT, weight_version=weight_version
    )


def num_requests_from_load(load: Any) -> int:
    """Running + waiting requests over the DP ranks of a `/v1/loads` answer (`{"loads": [...]}`,
    the same in every SGLang of the window and `agentrl serve`); 0 from any other shape."""
    ranks = load.get("loads") if isinstance(load, dict) else None
    if not isinstance(ranks, list):
        return 0
    return sum(
        int(r.get("num_running_reqs") or 0) + int(r.get("num_waiting_reqs") or 0)
        for r in ranks
        if isinstance(r, dict)
    )


def memory_bytes_from_server_info(info: dict[str, Any], released_tags: Any = ()) -> float:
    """Accelerator memory a server holds, from its server info. `agentrl serve` reports
    `memory_allocated_bytes` (live). SGLang reports `memory_usage` {weight, kvcache, graph} in GB,
    sized at start and unchanged by a release: the parts of `released_tags` are left out."""
    states = info.get("internal_states") or [{}]
    state = states[0] if isinstance(states[0], dict) else {}
    if "memory_allocated_bytes" in state:
        return float(state["memory_allocated_bytes"])
    usage = state.get("memory_usage") or {}
    graph = usage.get("graph") or {}
    parts = {
        "weights": float(usage.get("weight") or 0),
        "kv_cache": float(usage.get("kvcache") or 0),
        "cuda_graph": float(sum(graph.values())) if isinstance(graph, dict) else float(graph),
    }
    return sum(gb * 1e9 for tag, gb in parts.items() if tag not in set(released_tags))
