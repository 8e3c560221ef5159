"""The one weight bucketer: per-dtype buckets of bounded size, filled lazily."""

from __future__ import annotations

import torch

from agentrl.weights.buckets import bucket_by_dtype, nbytes


def test_buckets_hold_one_dtype_and_at_most_the_budget():
    named = [
        ("a", torch.zeros(10)),  # 40 bytes fp32
        ("b", torch.zeros(10, dtype=torch.bfloat16)),  # 20 bytes
        ("c", torch.zeros(10)),
        ("d", torch.zeros(40)),  # 160 bytes: larger than the budget, alone
        ("e", torch.zeros(10, dtype=torch.bfloat16)),
        ("f", torch.zeros(5)),
    ]
    buckets = list(bucket_by_dtype(named, bucket_size_bytes=100))
    assert [[n for n, _ in b] for b in buckets] == [["a", "c"], ["d"], ["f"], ["b", "e"]]
    for bucket in buckets:
        assert len({t.dtype for _, t in bucket}) == 1
        assert sum(nbytes(t) for _, t in bucket) <= 100 or len(bucket) == 1


def test_bucketing_is_lazy():
    pulled = []

    def tensors():
        for i in range(6):
            pulled.append(i)
            yield f"w{i}", torch.zeros(25)  # 100 bytes each

    buckets = bucket_by_dtype(tensors(), bucket_size_bytes=200)
    assert [n for n, _ in next(buckets)] == ["w0", "w1"]
    assert pulled == [0, 1, 2]  # the third tensor closed the first bucket; nothing more gathered


def test_unbounded_buckets_are_one_per_dtype_in_first_seen_order():
    named = [("a", torch.ones(4)), ("b", torch.ones(4, dtype=torch.bfloat16)), ("c", torch.ones(4))]
    groups = list(bucket_by_dtype(named))
    assert [[n for n, _ in g] for g in groups] == [["a", "c"], ["b"]]
