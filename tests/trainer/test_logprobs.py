"""Chunked logprobs equal the whole-logits computation, values and gradients."""

from __future__ import annotations

import pytest
import torch

from agentrl.trainer.logprobs import chunked_logprobs


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(13, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (13,), generator=gen)
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [1, 4, 13, 100])
def test_chunked_equals_unchunked(chunk_size: int):
    hidden, weight, targets = _inputs()
    temperature = 0.7
    logits = hidden @ weight.T / temperature
    full = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    probs = torch.softmax(logits, -1)
    full_entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    (full.sum() + full_entropy.sum()).backward()
    want_h, want_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    lp, ent = chunked_logprobs(
        hidden, weight, targets, chunk_size=chunk_size, temperature=temperature
    )
    assert torch.allclose(lp.double(), full, atol=1e-5)
    assert torch.allclose(ent.double(), full_entropy, atol=1e-5)
    (lp.sum() + ent.sum()).backward()
    assert torch.allclose(hidden.grad, want_h, atol=1e-4)
    assert torch.allclose(weight.grad, want_w, atol=1e-4)


def test_no_grad_path_and_bad_arguments():
    hidden, weight, targets = _inputs()
    with torch.no_grad():
        lp, _ = chunked_logprobs(hidden, weight, targets, chunk_size=5)
    assert lp.shape == (13,) and not lp.requires_grad and bool((lp <= 0).all())
    with pytest.raises(ValueError, match="logprob_chunk_size=0"):
        chunked_logprobs(hidden, weight, targets, chunk_size=0)
