"""The trainer's side (rank 0) of SGLang's weight-update group: join one torch.distributed group with
every engine rank, then per bucket post `/update_weights_from_distributed` to each server while
broadcasting the bucket. Same protocol as slime's `connect_rollout_engines_from_distributed` /
`update_weights_from_distributed`; a one-dtype bucket travels as SGLang's `flattened_bucket`
(one broadcast per bucket instead of one per tensor), as bytes: SGLang's receiver allocates the
bucket as uint8 (`FlattenedTensorBucket.empty`), and NCCL wants the same count and type on
every rank. `begin`/`end` wrap the buckets of one update in the engines' weight-update session
(the run's `WeightSender` protocol)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from agentrl.engine.base import EngineError
from agentrl.engine.sglang.launcher import free_ports
from agentrl.engine.weight_transport import destroy_process_group, init_weights_update_process_group

if TYPE_CHECKING:
    import torch


def flatten_into(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One fresh flat buffer holding `tensors` (one dtype) back to back, in order, viewed as
    bytes (what SGLang's receiver posts for a flattened bucket)."""
    import torch

    return torch.cat([t.detach().reshape(-1) for t in tensors]).view(torch.uint8)


class DistributedWeightSender:
    """Rank 0 of the weight-update group; engine ranks follow at offsets 1, 1+tp, ...

    `backend` None = NCCL when CUDA is available, else gloo."""

    def __init__(
        self,
        engines: list[Any],  # SGLangEngine clients (imported here, they would import this module)
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str | None = None,
    ) -> None:
        self.engines = engines
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.group_name = "weight_update_group"
        self._targets = [(e, u) for e in engines for u in e.worker_urls]
        self._pg: Any = None

    async def connect(self) -> None:
        import torch

        backend = self.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if self.master_port is None:
            (self.master_port,) = free_ports(1, self.master_address)
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
        await asyncio.gather(*(e.begin_weight_update() for e in self.engines))

    async def send(self, bucket: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        """Broadcast one bucket; `version` (pass it with the last bucket) takes effect on
        the engines with this call. A bucket of one dtype goes as one flat tensor."""
        if self._pg is None:
            raise EngineError("DistributedWeightSender.send before connect()")
        tensors = [t for _, t in bucket]
        is_flat = len({t.dtype for t in tensors}) == 1
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
        payload = [flatten_into(tensors)] if is_flat else tensors
        await asyncio.gather(asyncio.to_thread(self._broadcast, payload), *posts)

    async def end(self, version: str) -> None:
        await asyncio.gather(*(e.end_weight_update() for e in self.engines))

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
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
        with contextlib.suppress(EngineError):
            await asyncio.gather(
                asyncio.to_thread(destroy_process_group, pg),
                *(e.destroy_weights_update_group(self.group_name, url=u) for e, u in self._targets),
            )
