"""The engine's side of a broadcast weight update: flattened buckets and per-tensor receives,
on a one-rank gloo group (rank 0 broadcasting to itself leaves the buffers as they are)."""

from __future__ import annotations

import socket

import pytest
import torch

from agentrl.engine.sglang.weight_sender import flatten_into
from agentrl.engine.weight_receive import receive_broadcast
from agentrl.engine.weight_transport import destroy_process_group, init_weights_update_process_group


@pytest.fixture
def group():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pg = init_weights_update_process_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, world_size=1, rank=0,
        group_name="test_weight_transport",
    )  # fmt: skip
    yield pg
    destroy_process_group(pg)


def test_flattened_bucket_is_one_byte_buffer_viewed_per_name(group) -> None:
    """SGLang 0.5.23's receiver (`FlattenedTensorBucket.empty`): the bucket is bytes, so one
    bucket may hold several dtypes, each tensor at a multiple of its item size."""
    names, shapes = ["a", "b", "c"], [[2, 3], [4], [1, 5]]
    dtypes = ["float32", "float32", "bfloat16"]
    out = receive_broadcast(group, names, dtypes, shapes, load_format="flattened_bucket")
    assert [n for n, _ in out] == names
    assert [list(t.shape) for _, t in out] == shapes
    assert [t.dtype for _, t in out] == [torch.float32, torch.float32, torch.bfloat16]
    base = out[0][1].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for _, t in out)  # views of one buffer
    assert [t.untyped_storage().nbytes() for _, t in out] == [4 * 10 + 2 * 5] * 3
    assert [t.storage_offset() * t.element_size() for _, t in out] == [0, 24, 40]


def test_per_tensor_receive_keeps_each_dtype(group) -> None:
    out = receive_broadcast(group, ["a", "b"], ["float32", "bfloat16"], [[3], [2, 2]])
    assert [(t.dtype, list(t.shape)) for _, t in out] == [
        (torch.float32, [3]),
        (torch.bfloat16, [2, 2]),
    ]


def test_an_unaligned_or_negative_bucket_is_refused(group) -> None:
    with pytest.raises(ValueError, match="unaligned received tensor b: byte offset 2"):
        receive_broadcast(group, ["a", "b"], ["float16", "float32"], [[1], [1]],
                          load_format="flattened_bucket")  # fmt: skip
    with pytest.raises(ValueError, match="negative dimension in received tensor a"):
        receive_broadcast(group, ["a"], ["float32"], [[-1]], load_format="flattened_bucket")


def test_unknown_load_format_is_refused(group) -> None:
    with pytest.raises(ValueError, match="load_format='direct'"):
        receive_broadcast(group, ["a"], ["float32"], [[1]], load_format="direct")


def test_flatten_into_matches_the_concatenation() -> None:
    tensors = [torch.randn(2, 3), torch.randn(5), torch.randn(1, 1)]
    flat = flatten_into(tensors)  # bytes, as SGLang's receiver allocates them
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]).view(torch.uint8))
    assert all(flat.data_ptr() != t.data_ptr() for t in tensors)  # a fresh buffer
