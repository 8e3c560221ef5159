"""What the served-vs-in-process tests share: prompts, seeded sampling, one generation on each
side, and a reproducible change of weights."""

from __future__ import annotations

from typing import Any

import torch

from agentrl.engine.base import Completion, SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.engine.sglang import SGLangEngine

PROMPTS = [[1, 9690, 198, 2683, 314], [1, 4093, 198], [1, 30, 31, 32, 33, 34, 35], [1, 2683]]


def seeded(i: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=12, seed=1000 + i, **kw)


async def both(
    local: LocalEngine, http: SGLangEngine, sampling: SamplingParams, prompt: list[int]
) -> tuple[Completion, Completion]:
    """(in-process, served) completions of `prompt`."""
    return await local.generate(prompt, sampling), await http.generate(prompt, sampling)


def perturbed(engine: LocalEngine, scale: float) -> list[tuple[str, torch.Tensor]]:
    """Two of the engine's weights plus seeded noise, on the CPU."""
    names = ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
    state = engine.model.state_dict()
    gen = torch.Generator().manual_seed(7)
    return [(n, state[n].cpu() + scale * torch.randn(state[n].shape, generator=gen)) for n in names]
