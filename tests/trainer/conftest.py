"""Trainer fixtures: a tiny random Llama (vocab 64, hidden 32, 2 layers) and trajectory builders."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from agentrl.types import EpisodeStatus, StatusReason, Trajectory

VOCAB = 64


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    out = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(str(out))
    return str(Path(out))


def make_traj(
    segments: list[tuple[int, int]],
    *,
    reward: float = 0.0,
    status: EpisodeStatus = EpisodeStatus.COMPLETED,
    prompt_len: int = 3,
    seed: int = 0,
    group_id: str = "g",
) -> Trajectory:
    """A trajectory of `prompt_len` prompt ids then (num_sampled, num_observation) turns."""
    rng = random.Random(seed)
    ids = [rng.randrange(3, VOCAB) for _ in range(prompt_len)]
    mask = [0] * prompt_len
    for num_sampled, num_obs in segments:
        ids += [rng.randrange(3, VOCAB) for _ in range(num_sampled + num_obs)]
        mask += [1] * num_sampled + [0] * num_obs
    logprobs = [-rng.uniform(0.1, 3.0) for _ in range(sum(mask))]
    reason = StatusReason.DONE if status is EpisodeStatus.COMPLETED else StatusReason.ENGINE
    return Trajectory(
        token_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        prompt_len=prompt_len,
        reward=reward,
        status=status,
        status_reason=reason,
        group_id=group_id,
        episode_id=f"{group_id}-{seed}",
    )


def make_groups(num_groups: int = 3, group_size: int = 4, seed: int = 0) -> list[list[Trajectory]]:
    """Groups with varied lengths, multi-turn masks and rewards (no zero-variance group)."""
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        group = []
        for i in range(group_size):
            segments = [(rng.randint(1, 6), rng.randint(0, 4)) for _ in range(rng.randint(1, 3))]
            reward = float(i % 2) if i < 2 else rng.random()
            group.append(
                make_traj(
                    segments,
                    reward=reward,
                    prompt_len=rng.randint(2, 6),
                    seed=seed * 1000 + g * 10 + i,
                    group_id=f"g{g}",
                )
            )
        groups.append(group)
    return groups


@pytest.fixture
def traj():
    """The `make_traj` builder."""
    return make_traj


@pytest.fixture
def groups_factory():
    """The `make_groups` builder."""
    return make_groups
