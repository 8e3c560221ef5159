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


def test_no_grad_path():
    hidden, weight, targets = _inputs()
    with torch.no_grad():
        lp, _ = chunked_logprobs(hidden, weight, targets, chunk_size=5)
    assert lp.shape == (13,) and not lp.requires_grad and bool((lp <= 0).all())


def test_chunks_keep_no_vocab_sized_tensor_for_backward():
    gen = torch.Generator().manual_seed(1)
    num_tokens, vocab, chunk_size = 64, 1000, 16
    hidden = torch.randn(num_tokens, 8, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = chunked_logprobs(hidden, weight, targets, chunk_size=chunk_size)
    (lp.sum() + ent.sum()).backward()
    # Without chunking log_softmax keeps [tokens, vocab]; here at most the weight itself stays.
    assert saved and max(saved) <= weight.numel()
    assert hidden.grad is not None and weight.grad is not None


@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_causal_lm_logprobs_equal_the_models_own_logits_in_float32(tiny_llama_path, chunk_size):
    from transformers import AutoModelForCausalLM

    from agentrl.trainer.logprobs import CausalLMLogprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    input_ids = torch.randint(3, 64, (2, 11), generator=gen)
    positions = torch.arange(11).expand(2, 11)
    target_ids = torch.randint(3, 64, (2, 11), generator=gen)
    loss_mask = (torch.rand(2, 11, generator=gen) > 0.3).float()
    weights = torch.randn(2, 11, generator=gen)

    logits = model(input_ids=input_ids, position_ids=positions).logits.float() / 0.8
    all_logprobs = torch.log_softmax(logits, -1)
    want_lp = all_logprobs.gather(-1, target_ids[..., None]).squeeze(-1) * loss_mask
    want_ent = -(all_logprobs.exp() * all_logprobs).sum(-1) * loss_mask
    ((want_lp + 0.1 * want_ent) * weights).sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    policy = CausalLMLogprobs(model, chunk_size=chunk_size, temperature=0.8, autocast_dtype=None)
    lp, ent = policy(input_ids, positions, target_ids, loss_mask, True)
    assert (lp - want_lp).abs().max() <= 1e-6 and (ent - want_ent).abs().max() <= 1e-5
    ((lp + 0.1 * ent) * weights).sum().backward()
    for name, p in model.named_parameters():  # fp32 summation order: ~1e-6 on entries ~0.1
        assert torch.allclose(p.grad, want_grads[name], rtol=1e-5, atol=1e-6), name


def test_packed_attention_equals_transformers_own_packed_mask(tiny_llama_path: str):
    """Rows packing several sequences (positions restarting at 0, plus a pad tail): the packed
    attention the torch trainer uses on CUDA gives the logprobs and gradients of transformers'
    SDPA with the block mask it builds from position_ids; no token sees another sequence."""
    from transformers import AutoModelForCausalLM

    from agentrl.trainer.logprobs import CausalLMLogprobs
    from agentrl.trainer.packing import PACKED_ATTENTION, use_packed_attention

    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 64, (2, 12), generator=gen)
    positions = torch.tensor(
        [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 0, 1, 0, 1, 2]]
    )
    target_ids = torch.randint(3, 64, (2, 12), generator=gen)
    loss_mask = (torch.rand(2, 12, generator=gen) > 0.2).float()
    results = []
    for packed in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
        if packed:
            use_packed_attention(model)
            assert model.config._attn_implementation == PACKED_ATTENTION
        policy = CausalLMLogprobs(model, chunk_size=5, temperature=1.0, autocast_dtype=None)
        lp, ent = policy(input_ids, positions, target_ids, loss_mask, True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp, ent, {n: p.grad for n, p in model.named_parameters()}))
    (lp0, ent0, grads0), (lp1, ent1, grads1) = results
    assert (lp0 - lp1).abs().max() <= 1e-5 and (ent0 - ent1).abs().max() <= 1e-5
    for name, grad in grads0.items():
        assert torch.allclose(grads1[name], grad, rtol=1e-4, atol=1e-5), name

    # A sequence's logprobs do not depend on its row mates: change the first sequence's tokens.
    other = input_ids.clone()
    other[0, :4] = torch.randint(3, 64, (4,), generator=gen)
    with torch.no_grad():
        lp2, _ = policy(other, positions, target_ids, loss_mask)
    assert torch.equal(lp2[0, 4:], lp1[0, 4:].detach()) and not torch.equal(lp2[0, :3], lp1[0, :3])


def test_packed_attention_refuses_rows_that_do_not_start_a_sequence():
    from agentrl.trainer.packing import packed_attention_kwargs

    with pytest.raises(ValueError, match="every row to start a sequence"):
        packed_attention_kwargs(torch.tensor([[0, 1, 2], [3, 4, 5]]))
    bounds = packed_attention_kwargs(torch.tensor([[0, 1, 0], [0, 1, 2]]))
    assert bounds["cu_seq_lens_q"].tolist() == [0, 2, 3, 6] and bounds["max_length_q"] == 3
