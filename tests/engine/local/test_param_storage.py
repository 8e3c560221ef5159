"""Dropping a model's parameter storage on release and allocating it again on resume: shapes,
tied weights and buffers survive, and every tensor not yet re-sent is tracked."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from agentrl.engine.local.param_storage import drop_parameters, mark_written, reallocate_parameters


def test_dropped_weights_come_back_once_every_tensor_is_sent_again(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = model(ids).logits
    sent = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}

    dropped = drop_parameters(model)
    assert all(p.numel() == 0 for p in model.parameters())
    reallocate_parameters(dropped, "cpu")
    assert len(dropped.unsent) == len(list(model.parameters()))  # tied head counted once
    params = list(model.parameters())
    blocks = {p.untyped_storage().data_ptr() for p in params}
    assert len(blocks) == 1  # one allocation for the whole (fp32) model
    base = blocks.pop()
    assert all((p.data_ptr() - base) % 256 == 0 and p.is_contiguous() for p in params)
    state = model.state_dict()
    held_out = "model.norm.weight"
    with torch.no_grad():
        for name in sent:
            if name != held_out:
                state[name].copy_(sent[name])
                mark_written(dropped, state[name])
        assert len(dropped.unsent) == 1  # the held-out tensor is still uninitialised
        state[held_out].copy_(sent[held_out])
        mark_written(dropped, state[held_out])
    assert not dropped.unsent
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want)
