"""`SGLangControl`: `SGLangEngine`'s calls besides generation -- abort and drain, health and info,
pause/flush/memory, and weight updates -- sent to every worker where the call is per server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import httpx

from agentrl.engine.base import EngineError
from agentrl.engine.sglang.protocol import num_requests_from_load
from agentrl.engine.sglang.weight_sender import DistributedWeightSender
from agentrl.engine.weight_transport import flatten_bucket, serialize_for_ipc
from agentrl.weight_buckets import bucket_by_dtype

if TYPE_CHECKING:
    import torch


class SGLangControl:
    """Mixed into `SGLangEngine`, which owns the state and the HTTP plumbing declared here."""

    base_url: str
    weight_update_path: str
    _pending: set[asyncio.Future[Any]]
    _is_aborting: bool
    _weight_version: str
    _tp_size: int | None
    _sender: DistributedWeightSender | None

    if TYPE_CHECKING:

        @property
        def worker_urls(self) -> list[str]: ...

        def _http(self) -> httpx.AsyncClient: ...

        async def _post(
            self,
            path: str,
            payload: dict[str, Any] | None = None,
            *,
            url: str | None = None,
            timeout_s: float | None = None,
        ) -> Any: ...

        async def _get(
            self, path: str, *, url: str | None = None, timeout_s: float | None = None
        ) -> Any: ...

        async def _post_workers(
            self, path: str, payload: dict[str, Any] | None = None
        ) -> list[Any]: ...

    # -- abort and drain

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

    async def get_server_info(self, *, url: str | None = None) -> dict[str, Any]:
        """`/get_server_info` of one worker (default: the first)."""
        return await self._get("/get_server_info", url=url or self.worker_urls[0])

    async def get_weight_version(self) -> str:
        version = str(
            (await self._get("/get_weight_version", url=self.worker_urls[0]))["weight_version"]
        )
        self._weight_version = version
        return version

    # -- control

    async def flush_cache(self) -> None:
        await self._post_workers("/flush_cache")

    async def pause_generation(self, mode: str | None = None) -> None:
        """Hold generation on every worker. SGLang's modes: abort (running requests return
        ABORT; its default), retract (running requests go back to the queue, keeping their
        tokens, and continue after `continue_generation`), in_place (they stay where they are).
        None sends no mode (servers older than the modes)."""
        await self._post_workers("/pause_generation", None if mode is None else {"mode": mode})

    async def continue_generation(self) -> None:
        await self._post_workers("/continue_generation")

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """tags None = everything; SGLang tags are "weights", "kv_cache", "cuda_graph"."""
        await self._post_workers("/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._post_workers("/resume_memory_occupation", {"tags": tags})

    async def release_memory(self) -> None:
        await self.release_memory_occupation(None)

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """tags None: weights first, then the KV cache (the peak never holds both next to the
        trainer's memory)."""
        if tags is not None:
            await self.resume_memory_occupation(list(tags))
            return
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
        load_format: str | None = None,
        url: str | None = None,
    ) -> None:
        """`load_format="flattened_bucket"`: the bucket (one dtype) is broadcast as one flat tensor."""
        payload: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "load_format": load_format,
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
        """Push one bucket of weights (the trainer's exporter cuts the buckets; call once per
        bucket, `weight_version` takes effect with the call)."""
        if self.weight_update_path == "distributed":
            if self._sender is None:
                self._sender = DistributedWeightSender([self])
                await self._sender.connect()
            await self._sender.send(list(named_tensors), weight_version=weight_version)
            return
        tp_size = await self.tp_size()
        # The caller cut the buckets (sized); here each becomes one flat tensor per dtype.
        buckets = list(bucket_by_dtype(named_tensors))
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
