"""Weight export: each tensor once, whole; a cast before a gather only."""

from __future__ import annotations

import torch

from agentrl.weights.export import unique_named_tensors


def test_tied_weights_are_exported_once_and_unsharded_tensors_keep_their_dtype():
    emb = torch.nn.Embedding(8, 4)
    head = torch.nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    model.register_buffer("steps", torch.tensor([3]))
    named = dict(unique_named_tensors(model, gather_dtype=torch.bfloat16))
    assert list(named) == ["steps", "emb.weight"]
    # nothing to gather, so nothing cast: the packer casts in its one copy
    assert named["emb.weight"].dtype == torch.float32
    assert named["emb.weight"].data_ptr() == emb.weight.data_ptr()
