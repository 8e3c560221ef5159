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


def test_packed_buckets_are_views_of_one_fresh_buffer_cast_to_the_serving_dtype():
    from agentrl.weights.buckets import packed_buckets
    from agentrl.weights.wire import flat_base, flatten_bucket, flatten_into

    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5)), ("n", torch.arange(4))]
    buckets = list(packed_buckets(named, bucket_size_bytes=64, dtype=torch.bfloat16))
    # a and b count as bf16 (24 + 10 bytes <= 64); the long tensor keeps its dtype
    assert [[n for n, _ in b] for b in buckets] == [["a", "b"], ["n"]]
    (a, b), (n,) = [[t for _, t in bucket] for bucket in buckets]
    assert a.dtype == b.dtype == torch.bfloat16 and n.dtype == torch.long
    assert torch.equal(a, named[0][1].to(torch.bfloat16)) and torch.equal(n, named[2][1])
    base = flat_base([a, b])
    assert base is not None and base.numel() == 17 and base.data_ptr() == a.data_ptr()
    assert a.data_ptr() != named[0][1].data_ptr()  # a copy, not the trainer's own tensor
    # the senders flatten without copying a packed bucket ...
    assert flatten_into([a, b]).data_ptr() == base.data_ptr()
    assert flatten_bucket(buckets[0])["flattened_tensor"].data_ptr() == base.data_ptr()
    # ... and concatenate anything else, in the given order
    assert flat_base([b, a]) is None and flat_base([a]) is None
    assert torch.equal(flatten_into([b, a]).view(torch.bfloat16)[:5], b)
