"""`SGLangWeights`: the weight part of `SGLangEngine` (held as `client.weights`) -- updates from
disk, from tensors (flattened buckets over CUDA IPC or shared memory, one serialization per
tensor-parallel rank) and the routes a broadcast (`agentrl.weights.distributed`) drives, inside
SGLang's weight-update session where the server wants one, the prefix cache flushed once the new
weights are in. It is the `BroadcastTarget` the run's weight senders talk to."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from packaging.version import Version

from agentrl.engine.base import EngineError
from agentrl.weights.buckets import bucket_by_dtype
from agentrl.weights.wire import flatten_bucket, serialize_for_ipc

if TYPE_CHECKING:
    import torch

    from agentrl.engine.sglang.dialect import ServerDialect
    from agentrl.engine.sglang.plumbing import SGLangHTTP
    from agentrl.weights.adapter import AdapterExport

LORA_ROUTE = "/load_lora_adapter_from_tensors"


class _Client(Protocol):
    """What the weights part uses of the `SGLangEngine` that holds it."""

    http: SGLangHTTP
    weight_version: int
    lora_name: str | None
    _dialects: dict[str, ServerDialect]

    async def dialect(self, url: str | None = None) -> ServerDialect: ...
    async def tp_size(self, url: str | None = None) -> int: ...
    async def flush_cache(self) -> None: ...


class SGLangWeights:
    def __init__(self, client: _Client) -> None:
        self.client = client  # its dialects, flush and version; its `http` sends
        self.http = client.http
        self._is_updating = False  # inside a weight-update session opened by the caller

    @property
    def worker_urls(self) -> list[str]:
        return self.http.worker_urls

    async def tp_size(self, url: str | None = None) -> int:
        return await self.client.tp_size(url)

    # -- the session

    async def begin_weight_update(self) -> None:
        """Open a weight-update session on every worker that has them (SGLang 0.5.23 refuses
        tensor and broadcast updates outside one); older servers answer 404 once and are
        remembered as having none."""
        await asyncio.gather(*(self._begin_one(url) for url in self.worker_urls))
        self._is_updating = True

    async def _begin_one(self, url: str) -> None:
        dialects = self.client._dialects
        dialect = await self.client.dialect(url)
        if dialect.uses_weight_sessions is False:
            return
        try:
            await self.http.post("/begin_weight_update", {}, url=url)
        except EngineError as e:
            if "HTTP 404" in str(e) and dialect.uses_weight_sessions is None:
                dialects[url] = dataclasses.replace(dialect, uses_weight_sessions=False)
                return
            if "already open" not in str(e):
                raise
            # A trainer that died mid-update left it open: close it, then open ours.
            await self.http.post("/end_weight_update", {}, url=url)
            await self.http.post("/begin_weight_update", {}, url=url)
        dialects[url] = dataclasses.replace(dialect, uses_weight_sessions=True)

    async def end_weight_update(self, *, flush_cache: bool = True) -> None:
        """Close the session and flush the prefix cache, both at once (one round trip): KV
        computed with the old weights must not be reused, and every bucket is in by now (the
        flush is retried while the server still has requests queued)."""
        self._is_updating = False
        flush = [self.client.flush_cache()] if flush_cache else []
        await asyncio.gather(*(self._end_one(url) for url in self.worker_urls), *flush)

    async def _end_one(self, url: str) -> None:
        if (await self.client.dialect(url)).uses_weight_sessions:
            await self.http.post("/end_weight_update", {}, url=url)

    @contextlib.asynccontextmanager
    async def weight_update(self) -> AsyncIterator[None]:
        """One session around several `update_weights` calls (the trainer's buckets)."""
        await self.begin_weight_update()
        try:
            yield
        except BaseException:
            with contextlib.suppress(EngineError):
                await self.end_weight_update(flush_cache=False)
            raise
        await self.end_weight_update()

    # -- raw routes

    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: int | None = None
    ) -> None:
        payload = _versioned({"model_path": model_path, "flush_cache": False}, weight_version)
        await self.http.post_workers("/update_weights_from_disk", payload)
        await self.client.flush_cache()
        self._stamp(weight_version)

    async def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], *, weight_version: int | None = None
    ) -> None:
        """Raw endpoint: one serialized flattened bucket per tensor-parallel rank (each rank opens
        only its own). Never aborts running requests (SGLang's `abort_all_requests`); the flush
        comes once, after the session."""
        payload = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "abort_all_requests": False,
        }
        path = "/update_weights_from_tensor"
        await self.http.post_workers(path, _versioned(payload, weight_version))
        self._stamp(weight_version)

    async def update_weight_version(self, weight_version: int) -> None:
        """Stamp a version without new weights; running requests go on (SGLang's default for
        `abort_all_requests` is true: it would abort them)."""
        body = {"new_version": str(weight_version), "abort_all_requests": False}
        await self.http.post_workers("/update_weight_version", body)
        self.client.weight_version = weight_version

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
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        await self.http.post_checked("/init_weights_update_group", body, url=url)

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group", *, url: str | None = None
    ) -> None:
        await self.http.post("/destroy_weights_update_group", {"group_name": group_name}, url=url)

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: int | None = None,
        load_format: str | None = None,
        url: str | None = None,
    ) -> None:
        """`load_format="flattened_bucket"`: the bucket (one dtype) is broadcast as one flat run
        of bytes. The flush comes once, after the session (`end_weight_update`)."""
        payload = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": False,
            "abort_all_requests": False,
            "load_format": load_format,
        }
        path = "/update_weights_from_distributed"
        await self.http.post_checked(path, _versioned(payload, weight_version), url=url)
        self._stamp(weight_version)

    def _stamp(self, weight_version: int | None) -> None:
        """The version the client reports, once a server took weights under it."""
        if weight_version is not None:
            self.client.weight_version = weight_version

    # -- tensors

    async def update_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], *, weight_version: int | None
    ) -> None:
        """Push one bucket of weights (the trainer's exporter cuts the buckets; call once per
        bucket; `weight_version`, None to keep the served one, takes effect with the call).
        Outside `weight_update()` the call is a session of its own."""
        async with contextlib.nullcontext() if self._is_updating else self.weight_update():
            await self._push(named_tensors, weight_version)

    async def _push(
        self, named: list[tuple[str, torch.Tensor]], weight_version: int | None
    ) -> None:
        tp_size = await self.tp_size()
        buckets = list(bucket_by_dtype(named))  # one flat tensor per dtype
        for i, bucket in enumerate(buckets):
            flat = flatten_bucket(bucket)  # stays referenced until the server has copied it
            is_last = i == len(buckets) - 1
            # One serialization per rank: each registers its own CUDA-IPC reference, and a rank
            # that opened another's handle would break the sender's reference counting.
            await self.update_weights_from_tensor(
                [serialize_for_ipc(flat) for _ in range(tp_size)],
                weight_version=weight_version if is_last else None,
            )
        if not buckets and weight_version is not None:  # stamp the version alone
            await self.update_weight_version(weight_version)

    # -- LoRA

    async def load_lora_adapter(
        self, name: str, adapter: AdapterExport, *, weight_version: int
    ) -> None:
        """SGLang's `/load_lora_adapter_from_tensors` on every worker (the adapter as one flattened
        bucket, serialized once per tensor-parallel rank), then `weight_version` stamped; this
        client's requests name the adapter from then on. A name already loaded is the same policy
        version sent again (a sync after a heal): done."""
        flat = flatten_bucket([(n, t.detach().contiguous()) for n, t in adapter.named_tensors])
        load = (self._load_adapter_one(u, name, adapter, flat) for u in self.worker_urls)
        await asyncio.gather(*load)
        await self.update_weight_version(weight_version)
        self.client.lora_name = name

    async def _load_adapter_one(
        self, url: str, name: str, adapter: AdapterExport, flat: dict[str, Any]
    ) -> None:
        dialect = await self.client.dialect(url)
        copies = [serialize_for_ipc(flat) for _ in range(dialect.tp_size)]
        body: dict[str, Any] = {
            "lora_name": name,
            "config_dict": adapter.config_dict,
            "load_format": "flattened_bucket",
        }
        # 0.5.23 takes one copy per TP rank; 0.5.15 one string every rank opens
        if dialect.is_agentrl_serve or Version(dialect.version) >= Version("0.5.23"):
            body["serialized_named_tensors"] = copies
        else:
            body["serialized_tensors"] = copies[0]
        try:
            await self.http.post(LORA_ROUTE, body, url=url)
        except EngineError as e:
            if "already loaded" in str(e):
                return
            if "HTTP 404" in str(e):
                raise EngineError(
                    f"{url} ({dialect.version}) has no {LORA_ROUTE}: a LoRA run syncs its adapter "
                    "through it; serve with SGLang >= 0.5.15 or agentrl serve, or set "
                    "train.lora_rank=0"
                ) from None
            raise

    async def unload_lora_adapter(self, name: str) -> None:
        await self.http.post_workers("/unload_lora_adapter", {"lora_name": name})


def _versioned(payload: dict[str, Any], weight_version: int | None) -> dict[str, Any]:
    """SGLang's `weight_version`, a string, goes in a weight route's body only when there is one."""
    return payload if weight_version is None else {**payload, "weight_version": str(weight_version)}
