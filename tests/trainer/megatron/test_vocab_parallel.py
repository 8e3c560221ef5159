"""Vocab-parallel logprobs and entropy equal full-vocabulary log_softmax, values and gradients,
on one rank and split over two gloo ranks (each holding half the vocabulary)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agentrl.trainer.megatron.vocab_parallel import vocab_parallel_logprobs


def _reference(logits, targets, temperature=1.0):
    logprobs_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    logprobs = logprobs_all.gather(-1, targets[:, None])[:, 0]
    entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
    return logprobs, entropy


def _grads(fn, logits, weights):
    x = logits.clone().requires_grad_(True)
    lp, ent = fn(x)
    (lp * weights[0] + ent * weights[1]).sum().backward()
    return lp.detach(), ent.detach(), x.grad


def _case(seed=0, n=7, vocab=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    targets = torch.randint(0, vocab, (n,), generator=g)
    weights = torch.randn(2, n, generator=g, dtype=torch.float64)
    return logits, targets, weights


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_one_rank_equals_log_softmax(temperature):
    logits, targets, weights = _case()
    ours = _grads(lambda x: vocab_parallel_logprobs(x, targets, temperature=temperature), logits,
                  weights.float())  # fmt: skip
    ref = _grads(lambda x: _reference(x, targets, temperature), logits.double(), weights)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_padded_vocab_columns_are_left_out():
    logits, targets, weights = _case(vocab=12)
    padded = torch.cat([logits, torch.full((logits.shape[0], 4), 50.0)], dim=-1)  # 4 pad columns
    lp, ent = vocab_parallel_logprobs(padded, targets, vocab_size=12)
    ref_lp, ref_ent = _reference(logits, targets)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    x = padded.clone().requires_grad_(True)
    sum(t.sum() for t in vocab_parallel_logprobs(x, targets, vocab_size=12)).backward()
    assert torch.isfinite(x.grad).all() and not x.grad[:, 12:].any()


def _tp_worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        logits, targets, weights = _case(seed=1, vocab=13)  # 13 = 7 + 6 real columns, 1 padded
        padded = torch.cat([logits, torch.zeros(logits.shape[0], 1)], dim=-1)
        shard = padded.chunk(world, dim=-1)[rank]
        lp, ent, grad = _grads(
            lambda x: vocab_parallel_logprobs(x, targets, vocab_start=rank * 7, vocab_size=13,
                                              group=dist.group.WORLD, temperature=0.9),
            shard, weights.float(),
        )  # fmt: skip
        out[rank] = (lp, ent, grad)
    finally:
        dist.destroy_process_group()


def test_two_tp_ranks_equal_the_whole_vocabulary():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.get_context("spawn").Manager()
    out = manager.dict()
    mp.start_processes(_tp_worker, args=(2, port, out), nprocs=2, start_method="spawn")
    logits, targets, weights = _case(seed=1, vocab=13)
    ref_lp, ref_ent, ref_grad = _grads(
        lambda x: _reference(x, targets, 0.9), logits.double(), weights
    )
    for rank in range(2):
        lp, ent, grad = out[rank]
        torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
        columns = slice(rank * 7, min(rank * 7 + 7, 13))
        width = columns.stop - columns.start
        torch.testing.assert_close(
            grad[:, :width].double(), ref_grad[:, columns], rtol=1e-4, atol=1e-5
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_whole_vocabulary_on_cuda_equals_log_softmax(dtype):
    """On CUDA (one TP rank) forward and backward are compiled; values and gradients equal
    log_softmax's, over two token counts (the second makes the token dimension dynamic)."""
    for n in (37, 300):
        logits, targets, weights = _case(seed=n, n=n, vocab=1000)
        logits = logits.to("cuda", dtype)
        t = targets.cuda()
        ours = _grads(lambda x, t=t: vocab_parallel_logprobs(x, t, temperature=0.8), logits,
                      weights.float().cuda())  # fmt: skip
        ref = _grads(lambda x, t=t: _reference(x, t, 0.8), logits.double(), weights.cuda())
        tol = 5e-5 if dtype == torch.float32 else 2e-2  # fp32: compiled reductions' order
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)
        assert ours[2].dtype == dtype  # the gradient arrives in the logits' dtype
