"""Weight export: each tensor once, whole, in the serving dtype."""

from __future__ import annotations

import torch

from agentrl.weights.export import unique_named_tensors


def test_tied_weights_are_exported_once_and_dtype_casts_floats_only():
    emb = torch.nn.Embedding(8, 4)
    head = torch.nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    model.register_buffer("steps", torch.tensor([3]))
    named = dict(unique_named_tensors(model, dtype=torch.bfloat16))
    assert list(named) == ["steps", "emb.weight"]
    assert named["emb.weight"].dtype == torch.bfloat16 and named["steps"].dtype == torch.long
