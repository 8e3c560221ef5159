"""The one weight bucketer: (name, tensor) pairs grouped into per-dtype buckets of bounded size.
The trainer's exporters cut their weights with it, the SGLang client its flattened buckets."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

NamedTensors = list[tuple[str, "Tensor"]]


def nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucket_by_dtype(
    named_tensors: Iterable[tuple[str, Tensor]], bucket_size_bytes: float = math.inf
) -> Iterator[NamedTensors]:
    """Buckets that each hold one dtype and at most `bucket_size_bytes` (a larger tensor alone;
    unbounded: one per dtype), dtypes and names in first-seen order. Lazy: a bucket is yielded
    once the next tensor of its dtype would overflow it, so one open bucket per dtype is alive."""
    open_buckets: dict[Any, tuple[NamedTensors, int]] = {}
    for name, tensor in named_tensors:
        bucket, size = open_buckets.get(tensor.dtype, ([], 0))
        if bucket and size + nbytes(tensor) > bucket_size_bytes:
            yield bucket
            bucket = []
            size = 0
        bucket.append((name, tensor))
        open_buckets[tensor.dtype] = (bucket, size + nbytes(tensor))
    for bucket, _ in open_buckets.values():
        yield bucket
