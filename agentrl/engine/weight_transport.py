"""How weights travel into a running engine: SGLang's `flattened_bucket` tensor format and its
IPC serialization (`/update_weights_from_tensor`), checkpoint loading (`/update_weights_from_disk`),
and the torch.distributed group of `/init_weights_update_group` + `/update_weights_from_distributed`
(the trainer's side of that group is `agentrl.engine.sglang.weight_sender`).

Matches sgl-project/sglang `python/sglang/srt/weight_sync/tensor_bucket.py`,
`MultiprocessingSerializer` (`python/sglang/srt/utils`) and THUDM/slime
`slime/backends/megatron_utils/update_weight/update_weight_from_{tensor,distributed}.py`.
"""

from __future__ import annotations

import base64
import contextlib
import io
import threading
import types
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch
    from torch.distributed.distributed_c10d import GroupName


def bucket_metadata(name: str, shape: Any, dtype: Any, start: int, end: int) -> Any:
    """One entry of a bucket's metadata, as a class a real SGLang server unpickles: its own
    `FlattenedTensorMetadata` when sglang is importable here, else `types.SimpleNamespace`
    (the other type its SafeUnpickler admits; SGLang reads the fields by name)."""
    from agentrl.engine.sglang.compat import flattened_metadata_class

    cls = flattened_metadata_class() or types.SimpleNamespace
    return cls(name=name, shape=shape, dtype=dtype, start_idx=start, end_idx=end, numel=end - start)


def flatten_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """One dtype's tensors -> {"flattened_tensor", "metadata"} (SGLang's `flattened_bucket`).

    Indices count elements of the bucket's own dtype (not bytes), which both the old
    (`.to(dtype)`) and new (`.view(dtype)`) SGLang reconstructions read correctly. The flat
    tensor is a fresh buffer per bucket: reusing one across buckets corrupts weights (slime).
    """
    import torch

    dtypes = {t.dtype for _, t in named_tensors}
    if len(dtypes) != 1:
        raise ValueError(f"a flattened bucket holds one dtype, got {sorted(map(str, dtypes))}")
    metadata, start = [], 0
    for name, t in named_tensors:
        metadata.append(bucket_metadata(name, t.shape, t.dtype, start, start + t.numel()))
        start += t.numel()
    flat = torch.cat([t.detach().reshape(-1) for _, t in named_tensors])
    return {"flattened_tensor": flat, "metadata": metadata}


def reconstruct_bucket(bucket: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    flat = bucket["flattened_tensor"]
    out = []
    for m in bucket["metadata"]:
        t = flat[m.start_idx : m.end_idx]
        if t.dtype != m.dtype:  # a byte-view bucket (new SGLang) or a cast
            t = t.view(m.dtype) if t.dtype.itemsize == 1 else t.to(m.dtype)
        out.append((m.name, t.reshape(m.shape)))
    return out


_SHARING_LOCK = threading.Lock()


def serialize_for_ipc(obj: Any) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)`: a ForkingPickler dump,
    base64-encoded. CUDA tensors travel as CUDA IPC handles (what real SGLang expects); CPU tensors
    as shared-memory file names (`file_system` strategy), so the bytes never go over HTTP. Either
    way the receiver must be on the same host and the sender must keep the tensors alive until the
    request returns. SGLang's patch of the CUDA reductions (device UUIDs) is applied only for
    CUDA tensors: it rewrites an argument that CPU tensors' reductions do not have."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    from agentrl.engine.sglang.compat import patch_torch_reductions

    if _holds_cuda_tensor(obj):
        patch_torch_reductions()  # device UUIDs instead of ordinals, as SGLang does
    buf = io.BytesIO()
    with _SHARING_LOCK:
        old = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")
        try:
            ForkingPickler(buf).dump(obj)
        finally:
            tmp.set_sharing_strategy(old)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _holds_cuda_tensor(obj: Any) -> bool:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, dict):
        return any(_holds_cuda_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_cuda_tensor(v) for v in obj)
    return False


# ---------------------------------------------------------------- weight-update process group


def init_weights_update_process_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 300.0,
) -> Any:
    """A process group outside the default one (trainer rank 0 + every engine rank), built the way
    SGLang's `init_custom_process_group` and slime's `init_process_group` build it, so our trainer
    side and a real SGLang server (or `agentrl serve`) can join the same group. Blocks until all
    `world_size` ranks have joined."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )
    from torch.distributed.rendezvous import rendezvous

    timeout = timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(
        rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=cast("GroupName", group_name),
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {
        i: i for i in range(world_size)
    }  # broadcast(src=0) means group rank 0
    assert dist.get_world_size(pg) == world_size
    return pg


def destroy_process_group(pg: Any) -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        dist.destroy_process_group(pg)
