"""Weight export: a model's HF-named tensors, gathered whole from their shards one at a time, and
the one bucketer that groups them into per-dtype buckets of a bounded size for the engines."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

try:  # a DTensor is what FSDP2 leaves in place of each parameter
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = ()  # type: ignore[assignment,misc]

NamedTensors = list[tuple[str, Tensor]]
DEFAULT_BUCKET_SIZE_BYTES = 2 * 2**30  # cluster.update_weight_buffer_size (slime: 512 MiB)


def nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor: gathered from every rank if it is a DTensor (collective), else itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def unique_named_tensors(
    model: torch.nn.Module, *, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, Tensor]]:
    """(HF name, whole tensor) of each parameter and persistent buffer, each object once: a tied
    lm_head is left out, as save_pretrained does. Gathers lazily, in state_dict order, so every
    rank must iterate to the end together and at most one gathered tensor is alive per step."""
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)  # before the gather: fewer bytes on the wire
        yield name, full_tensor(tensor)


def bucket_by_dtype(
    named_tensors: Iterable[tuple[str, Tensor]], bucket_size_bytes: int
) -> Iterator[NamedTensors]:
    """Buckets that each hold one dtype and at most `bucket_size_bytes` (a larger tensor alone).

    Lazy: a bucket is yielded as soon as the next tensor of its dtype would overflow it, so at
    most one open bucket per dtype is alive. Names keep their order within each dtype."""
    if bucket_size_bytes < 1:
        raise ValueError(
            f"bucket_size_bytes={bucket_size_bytes} must be >= 1 "
            "(cluster.update_weight_buffer_size; the default is 2 GiB, slime's 512 MiB)"
        )
    open_buckets: dict[torch.dtype, tuple[NamedTensors, int]] = {}
    for name, tensor in named_tensors:
        bucket, size = open_buckets.get(tensor.dtype, ([], 0))
        if bucket and size + nbytes(tensor) > bucket_size_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        open_buckets[tensor.dtype] = (bucket, size + nbytes(tensor))
    for bucket, _ in open_buckets.values():
        yield bucket


def serving_dtype(dtype: str, is_cuda: bool) -> torch.dtype:
    """The dtype engines hold weights in (`model.dtype`; auto = bf16 on CUDA, fp32 on CPU):
    what weight sync sends, so a bf16 engine never receives fp32 master weights."""
    if dtype == "auto":
        return torch.bfloat16 if is_cuda else torch.float32
    return getattr(torch, dtype)
