"""The distributed transport: the trainer's rank 0 joins one torch.distributed group with every
engine rank (NCCL on GPU, gloo on CPU; across hosts), then per bucket posts
`/update_weights_from_distributed` to each server while broadcasting the bucket. Same protocol
as slime's `update_weights_from_distributed`; a one-dtype bucket travels as SGLang's
`flattened_bucket` (one broadcast per bucket instead of one per tensor), as bytes: SGLang's
receiver allocates the bucket as uint8 (`FlattenedTensorBucket.empty`), and NCCL wants the same
count and type on every rank."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from agentrl.weights.group import (
    destroy_process_group,
    host_store,
    init_weights_update_process_group,
)
from agentrl.weights.sender import BroadcastTarget, Bucket
from agentrl.weights.wire import flatten_into


class DistributedSender:
    """Rank 0 of the weight-update group; engine ranks follow at offsets 1, 1+tp, ...

    `backend` None = NCCL when CUDA is available, else gloo. `master_port` None: rank 0 hosts
    the group's store on a port the OS picks."""

    def __init__(
        self,
        engines: Sequence[BroadcastTarget],
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str | None = None,
    ) -> None:
        self.engines = list(engines)
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.group_name = "weight_update_group"
        self.phases: dict[str, float] = defaultdict(float)
        self._targets = [(e, u) for e in self.engines for u in e.worker_urls]
        self._pg: Any = None

    async def connect(self) -> None:
        import torch

        backend = self.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        store = None
        if self.master_port is None:
            store = host_store(self.master_address)
            self.master_port = int(store.port)
        tp_sizes = [await e.tp_size(u) for e, u in self._targets]
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
        world_size = 1 + sum(tp_sizes)
        join = asyncio.to_thread(
            init_weights_update_process_group,
            backend=backend,
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=world_size,
            rank=0,
            group_name=self.group_name,
            store=store,
        )
        posts = [
            e.init_weights_update_group(
                master_address=self.master_address,
                master_port=self.master_port,
                rank_offset=offset,
                world_size=world_size,
                group_name=self.group_name,
                backend=backend,
                url=u,
            )
            for (e, u), offset in zip(self._targets, offsets, strict=True)
        ]
        self._pg, *_ = await asyncio.gather(join, *posts)
        self.backend = backend

    async def begin(self) -> None:
        self.phases = defaultdict(float)
        await asyncio.gather(*(e.begin_weight_update() for e in self.engines))

    async def send(self, bucket: Bucket, version: int | None) -> None:
        """Broadcast one bucket; `version` (pass it with the last bucket) takes effect on
        the engines with this call. A bucket of one dtype goes as one flat tensor."""
        if self._pg is None:
            raise RuntimeError("DistributedSender.send before connect()")
        t0 = time.perf_counter()
        tensors = [t for _, t in bucket]
        is_flat = len({t.dtype for t in tensors}) == 1
        payload = [flatten_into(tensors)] if is_flat else tensors
        t1 = time.perf_counter()
        posts = [
            e.update_weights_from_distributed(
                names=[n for n, _ in bucket],
                dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
                shapes=[list(t.shape) for t in tensors],
                group_name=self.group_name,
                weight_version=version,
                load_format="flattened_bucket" if is_flat else None,
                url=u,
            )
            for e, u in self._targets
        ]
        await asyncio.gather(asyncio.to_thread(self._broadcast, payload), *posts)
        self.phases["flatten_s"] += t1 - t0
        self.phases["send_s"] += time.perf_counter() - t1

    async def end(self, version: int) -> None:
        t0 = time.perf_counter()
        await asyncio.gather(*(e.end_weight_update() for e in self.engines))
        self.phases["end_s"] = time.perf_counter() - t0

    def _broadcast(self, tensors: list[Any]) -> None:
        import torch.distributed as dist

        for t in tensors:
            t = t.detach()
            if self.backend == "gloo" and t.is_cuda:
                t = t.cpu()
            dist.broadcast(t.contiguous(), 0, group=self._pg)

    async def close(self) -> None:
        if self._pg is None:
            return
        # Both sides at once: tearing down an NCCL communicator waits for its peers, so destroying
        # the engines' side before ours (or ours before theirs) would hang.
        pg, self._pg = self._pg, None
        with contextlib.suppress(Exception):  # a server already gone has nothing to tear down
            await asyncio.gather(
                asyncio.to_thread(destroy_process_group, pg),
                *(e.destroy_weights_update_group(self.group_name, url=u) for e, u in self._targets),
            )
