"""The engine's side of a broadcast weight update: flattened buckets and per-tensor receives,
on a one-rank gloo group (rank 0 broadcasting to itself leaves the buffers as they are), and the
values a real second process (rank 0, the trainer's side) broadcasts to this one (rank 1)."""

from __future__ import annotations

import gc
import socket
import subprocess
import sys

import pytest
import torch

from agentrl.weights.group import destroy_process_group, init_weights_update_process_group
from agentrl.weights.receive import receive_broadcast
from agentrl.weights.wire import flatten_into


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def group():
    port = _free_port()
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


# Rank 0 in its own process: a flattened bucket of two dtypes, then two tensors one by one.
_SENDER = """
import sys, torch, torch.distributed as dist
from agentrl.weights.wire import flatten_into
from agentrl.weights.group import destroy_process_group, init_weights_update_process_group
pg = init_weights_update_process_group(backend="gloo", master_address="127.0.0.1",
    master_port=int(sys.argv[1]), world_size=2, rank=0, group_name="two_ranks", timeout_s=60)
a, b = torch.arange(6.0).reshape(2, 3), torch.arange(4.0) + 10
c = torch.tensor([[0.5, 1.5, 2.5, 3.5, 4.5]], dtype=torch.bfloat16)
dist.broadcast(torch.cat([flatten_into([a, b]), flatten_into([c])]), 0, group=pg)
for t in (torch.tensor([7, 8, 9]), torch.full((2, 2), -1.25, dtype=torch.float16)):
    dist.broadcast(t, 0, group=pg)
destroy_process_group(pg)
sys.stdin.read()  # rank 0 hosts the store: it exits after rank 1 has let go of it (else ~1 run in
# 8 aborted at exit, "terminate called without an active exception", its store still connected)
"""


def test_a_second_process_broadcasts_the_values_this_one_receives() -> None:
    port = _free_port()
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, str(port)], stdin=subprocess.PIPE)
    try:
        pg = init_weights_update_process_group(
            backend="gloo", master_address="127.0.0.1", master_port=port, world_size=2, rank=1,
            group_name="two_ranks", timeout_s=60,
        )  # fmt: skip
        bucket = receive_broadcast(
            pg, ["a", "b", "c"], ["float32", "float32", "bfloat16"], [[2, 3], [4], [1, 5]],
            load_format="flattened_bucket",
        )  # fmt: skip
        tensors = receive_broadcast(pg, ["x", "y"], ["int64", "float16"], [[3], [2, 2]])
        destroy_process_group(pg)
        del pg  # and with it this rank's connection to the sender's store
        gc.collect()
    finally:
        assert sender.stdin is not None
        sender.stdin.close()
        assert sender.wait(timeout=60) == 0
    got = {name: t.float().tolist() for name, t in (*bucket, *tensors)}
    assert got == {
        "a": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]],
        "b": [10.0, 11.0, 12.0, 13.0],
        "c": [[0.5, 1.5, 2.5, 3.5, 4.5]],
        "x": [7.0, 8.0, 9.0],
        "y": [[-1.25, -1.25], [-1.25, -1.25]],
    }
