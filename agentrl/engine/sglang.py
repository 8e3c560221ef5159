"""`SGLangEngine`: the `Engine` protocol over SGLang's native HTTP API (httpx).

Request and response shapes follow sgl-project/sglang `python/sglang/srt/entrypoints/http_server.py`
and `python/sglang/srt/managers/io_struct.py`; the call pattern follows THUDM/slime
`slime/rollout/sglang_rollout.py` and `slime/backends/sglang_utils/sglang_engine.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

import httpx

from agentrl.engine.base import Completion, EngineError, FinishReason, SamplingParams
from agentrl.engine.weight_transport import (
    DistributedWeightSender,
    bucket_named_tensors,
    flatten_bucket,
    serialize_for_ipc,
)

if TYPE_CHECKING:
    import torch

    from agentrl.engine.launcher import SGLangCluster

logger = logging.getLogger(__name__)

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""sglang-router (SGLang Model Gateway) reads this header for its `consistent_hashing` and
`manual` policies; slime sends the episode's session id in it."""

DEFAULT_WEIGHT_VERSION = "default"  # SGLang ServerArgs.weight_version before any update
_RETRYABLE_STATUS = frozenset({500, 502, 503, 504})


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
        weight_version=str(meta.get("weight_version", DEFAULT_WEIGHT_VERSION)),
        matched_stop=reason.get("matched") if isinstance(reason, dict) else None,
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        cached_tokens=int(meta.get("cached_tokens") or 0),
    )


def aborted_completion(weight_version: str) -> Completion:
    return Completion(
        ids=[], logprobs=[], finish_reason=FinishReason.ABORT, weight_version=weight_version
    )


def num_requests_from_load(load: Any) -> int:
    """Running + waiting requests from `/v1/loads` or `/get_load` (shapes differ across SGLang
    versions; same tolerance as slime's server_control.num_requests_from_load)."""
    if isinstance(load, list):
        return sum(num_requests_from_load(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return num_requests_from_load(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    running = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running if isinstance(running, int) else 0) + (
        waiting if isinstance(waiting, int) else 0
    )


# ---------------------------------------------------------------- the client


class SGLangEngine:
    """An `Engine` backed by one SGLang server, a router over several, or `agentrl serve`.

    Generation goes to `base_url` (a router spreads it; the `routing_key` header keeps an episode
    on one server, so its prefix cache stays warm). Control calls (weights, memory, pause, flush,
    abort) go to every worker: `cluster.worker_urls` when launched by agentrl, else `base_url`.

    Retries: connection errors and 500/502/503/504 are retried `max_retries` times with
    exponential backoff; 4xx never (the request is wrong, a retry cannot help). A request that
    exceeds `request_timeout_s`, or fails after its retries, raises `EngineError`.

    `update_weights` path: "tensor" (default) sends flattened buckets through
    `/update_weights_from_tensor` -- same host only (CUDA IPC for GPU tensors, shared memory for
    CPU tensors); "distributed" broadcasts over a torch.distributed group (gloo on CPU, NCCL on
    GPU) and works across hosts.
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 256,
        request_timeout_s: float = 600.0,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        weight_update_path: Literal["tensor", "distributed"] = "tensor",
        max_bucket_bytes: int = 1 << 30,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"SGLangEngine base_url={base_url!r} must start with http:// or https://"
            )
        if max_connections < 1 or max_retries < 0 or request_timeout_s <= 0:
            raise ValueError(
                f"SGLangEngine needs max_connections >= 1, max_retries >= 0, request_timeout_s > 0; got "
                f"{max_connections}, {max_retries}, {request_timeout_s}"
            )
        if weight_update_path not in ("tensor", "distributed"):
            raise ValueError(
                f"weight_update_path={weight_update_path!r}; use 'tensor' or 'distributed'"
            )
        self.base_url = base_url.rstrip("/")
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.weight_update_path = weight_update_path
        self.max_bucket_bytes = max_bucket_bytes
        self.cluster: SGLangCluster | None = None  # set by make_engine for launched servers
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._pending: set[asyncio.Future[Any]] = set()
        self._background: set[asyncio.Future[Any]] = set()
        self._is_aborting = False
        self._weight_version = DEFAULT_WEIGHT_VERSION
        self._tp_size: int | None = None
        self._sender: DistributedWeightSender | None = None

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def worker_urls(self) -> list[str]:
        return list(self.cluster.worker_urls) if self.cluster is not None else [self.base_url]

    # -- HTTP plumbing

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:  # a client is bound to one loop
            limits = httpx.Limits(
                max_connections=self.max_connections, max_keepalive_connections=self.max_connections
            )
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.request_timeout_s), limits=limits
            )
            self._client_loop = loop
        return self._client

    async def _request(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        timeout = httpx.Timeout(timeout_s or self.request_timeout_s)
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(
                    self.retry_backoff_s * 2 ** (attempt - 1) * (1 + 0.1 * random.random())
                )
            try:
                response = await self._http().request(
                    method, url, json=json, headers=headers, timeout=timeout
                )
            except (
                httpx.ConnectError,
                httpx.ConnectTimeout,
                httpx.RemoteProtocolError,
                httpx.ReadError,
            ) as e:
                last_error = f"{type(e).__name__}: {e}"
                continue
            except httpx.TimeoutException as e:
                raise EngineError(
                    f"{method} {url} timed out after {timeout_s or self.request_timeout_s}s ({type(e).__name__}); "
                    "raise engine.request_timeout_s if generations are legitimately this long"
                ) from e
            if response.status_code in _RETRYABLE_STATUS:
                last_error = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code >= 400:
                raise EngineError(
                    f"{method} {url} -> HTTP {response.status_code} (not retried): {response.text[:500]}"
                )
            return response
        raise EngineError(
            f"{method} {url} failed after {self.max_retries + 1} attempts; last error: {last_error}"
            + self._cluster_note()
        )

    def _cluster_note(self) -> str:
        """A launched server that died explains the connection errors: say so, with its logs."""
        report = self.cluster.failure_report() if self.cluster is not None else None
        return f"\n{report}" if report else ""

    async def _post(
        self,
        path: str,
        payload: dict[str, Any] | None = None,
        *,
        url: str | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        response = await self._request(
            "POST", f"{url or self.base_url}{path}", json=payload or {}, timeout_s=timeout_s
        )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    async def _get(
        self, path: str, *, url: str | None = None, timeout_s: float | None = None
    ) -> Any:
        response = await self._request("GET", f"{url or self.base_url}{path}", timeout_s=timeout_s)
        return response.json() if response.content else None

    async def _post_workers(self, path: str, payload: dict[str, Any] | None = None) -> list[Any]:
        results = await asyncio.gather(
            *(self._post(path, payload, url=u) for u in self.worker_urls)
        )
        for url, result in zip(self.worker_urls, results, strict=False):
            if isinstance(result, dict) and result.get("success") is False:
                raise EngineError(f"POST {url}{path} failed: {result.get('message')}")
        return list(results)

    # -- generation

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, routing_key: str | None = None
    ) -> Completion:
        if not input_ids:
            raise ValueError("generate needs a non-empty input_ids")
        if self._is_aborting:
            return aborted_completion(self._weight_version)
        payload = {
            "rid": uuid.uuid4().hex,
            "input_ids": list(input_ids),
            "sampling_params": sampling.to_sglang(),
            "return_logprob": True,
            "logprob_start_len": -1,  # GenerateReqInput: -1 = logprobs of output tokens only
        }
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        request = asyncio.ensure_future(
            self._request("POST", f"{self.base_url}/generate", json=payload, headers=headers)
        )
        self._pending.add(request)
        try:
            response = await asyncio.shield(request)
        except asyncio.CancelledError:
            if request.cancelled():  # abort() cancelled it: the episode sees ABORT
                return aborted_completion(self._weight_version)
            # Our caller was cancelled (an episode timeout): free the server's work too.
            request.cancel()
            cleanup = asyncio.ensure_future(self._abort_rid(payload["rid"]))
            self._background.add(cleanup)
            cleanup.add_done_callback(self._background.discard)
            raise
        finally:
            self._pending.discard(request)
        completion = completion_from_sglang(response.json())
        self._weight_version = completion.weight_version
        return completion

    async def _abort_rid(self, rid: str) -> None:
        with contextlib.suppress(EngineError):
            await asyncio.gather(
                *(self._post("/abort_request", {"rid": rid}, url=u) for u in self.worker_urls)
            )

    async def abort(self, *, poll_interval_s: float = 0.5, max_wait_s: float = 60.0) -> None:
        """Drain: refuse new requests, cancel the pending local ones (they return ABORT), then
        `abort_request {abort_all: true}` on every worker until it reports nothing running."""
        self._is_aborting = True
        try:
            for request in list(self._pending):
                request.cancel()
            await asyncio.gather(
                *(self._abort_until_idle(u, poll_interval_s, max_wait_s) for u in self.worker_urls)
            )
        finally:
            self._is_aborting = False

    async def _abort_until_idle(self, url: str, poll_interval_s: float, max_wait_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_wait_s
        while True:
            await self._post("/abort_request", {"abort_all": True}, url=url)
            num_requests = await self.num_requests(url)
            if num_requests <= 0:
                return
            if loop.time() > deadline:
                raise EngineError(
                    f"{url} still runs {num_requests} requests {max_wait_s}s after abort_request"
                )
            await asyncio.sleep(poll_interval_s)

    async def num_requests(self, url: str | None = None) -> int:
        """Running + waiting requests on one server (`/v1/loads`, or `/get_load` on older SGLang)."""
        try:
            return num_requests_from_load(await self._get("/v1/loads?include=core", url=url))
        except EngineError as e:
            if "HTTP 404" not in str(e):
                raise
        return num_requests_from_load(await self._get("/get_load", url=url))

    # -- health and info

    async def health(self) -> bool:
        try:
            response = await self._http().get(f"{self.base_url}/health_generate", timeout=30.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def wait_healthy(self, timeout_s: float = 600.0, interval_s: float = 1.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.health():
            if loop.time() > deadline:
                raise EngineError(
                    f"{self.base_url}/health_generate did not answer 200 within {timeout_s}s"
                )
            await asyncio.sleep(interval_s)

    async def get_model_info(self) -> dict[str, Any]:
        return await self._get("/get_model_info")

    async def get_server_info(self) -> dict[str, Any]:
        return await self._get("/get_server_info", url=self.worker_urls[0])

    async def get_weight_version(self) -> str:
        version = str(
            (await self._get("/get_weight_version", url=self.worker_urls[0]))["weight_version"]
        )
        self._weight_version = version
        return version

    # -- control

    async def flush_cache(self) -> None:
        await self._post_workers("/flush_cache")

    async def pause_generation(self) -> None:
        await self._post_workers("/pause_generation")

    async def continue_generation(self) -> None:
        await self._post_workers("/continue_generation")

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """tags None = everything; SGLang tags are "weights", "kv_cache", "cuda_graph"."""
        await self._post_workers("/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._post_workers("/resume_memory_occupation", {"tags": tags})

    async def release_memory(self) -> None:
        await self.release_memory_occupation(None)

    async def resume_memory(self) -> None:
        # Weights first, then the KV cache: the peak never holds both with the trainer's memory.
        await self.resume_memory_occupation(["weights"])
        await self.resume_memory_occupation(["kv_cache", "cuda_graph"])

    # -- weights

    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None = None, load_format: str | None = None
    ) -> None:
        payload: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        await self._post_workers("/update_weights_from_disk", payload)
        if weight_version is not None:
            self._weight_version = weight_version

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = "flattened_bucket",
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> None:
        """Raw endpoint: one serialized entry per tensor-parallel rank."""
        payload: dict[str, Any] = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        await self._post_workers("/update_weights_from_tensor", payload)
        if weight_version is not None:
            self._weight_version = weight_version

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        url: str | None = None,
    ) -> None:
        result = await self._post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
            url=url,
        )
        if isinstance(result, dict) and not result.get("success", True):
            raise EngineError(f"init_weights_update_group failed: {result.get('message')}")

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group", *, url: str | None = None
    ) -> None:
        await self._post("/destroy_weights_update_group", {"group_name": group_name}, url=url)

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = False,
        weight_version: str | None = None,
        url: str | None = None,
    ) -> None:
        payload: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        result = await self._post("/update_weights_from_distributed", payload, url=url)
        if isinstance(result, dict) and not result.get("success", True):
            raise EngineError(f"update_weights_from_distributed failed: {result.get('message')}")
        if weight_version is not None:
            self._weight_version = weight_version

    async def tp_size(self) -> int:
        if self._tp_size is None:
            self._tp_size = int((await self.get_server_info()).get("tp_size", 1))
        return self._tp_size

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, weight_version: str
    ) -> None:
        if self.weight_update_path == "distributed":
            if self._sender is None:
                self._sender = DistributedWeightSender([self])
                await self._sender.connect()
            await self._sender.send(list(named_tensors), weight_version=weight_version)
            return
        tp_size = await self.tp_size()
        buckets = bucket_named_tensors(named_tensors, self.max_bucket_bytes)
        for i, bucket in enumerate(buckets):
            flat = flatten_bucket(bucket)  # stays referenced until the server has copied it
            is_last = i == len(buckets) - 1
            await self.update_weights_from_tensor(
                [serialize_for_ipc(flat)] * tp_size,
                load_format="flattened_bucket",
                flush_cache=is_last,
                weight_version=weight_version if is_last else None,
            )
        if not buckets:
            await self._post_workers("/update_weight_version", {"new_version": weight_version})
        self._weight_version = weight_version

    async def close(self) -> None:
        if self._sender is not None:
            await self._sender.close()
            self._sender = None
        if self._client is not None:
            with contextlib.suppress(RuntimeError):  # its loop may be gone already
                await self._client.aclose()
            self._client = None
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
