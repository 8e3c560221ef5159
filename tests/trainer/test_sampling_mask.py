"""Sampling-mask replay: the trainer keeps the tokens the engine's top-k/top-p filter kept, and a
truncated-sampling rollout from the embedded engine then matches the trainer's logprobs."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.engine.base import SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.engine.local.sampling import filter_top_k_top_p
from agentrl.rollout.episode import EpisodeRecord
from agentrl.trainer.batch import TrainBatch, build_train_batches
from agentrl.trainer.sampling_mask import kept_tokens
from agentrl.trainer.torch_backend import TorchBackend
from agentrl.types import EpisodeStatus, StatusReason, Task, Trajectory


def test_kept_tokens_are_the_embedded_engines_filter():
    """The trainer may not import the engine: its copy of the filter keeps the same tokens, top-k
    off (-1), 1, some and past the vocabulary, top-p off, tiny and any."""
    gen = torch.Generator().manual_seed(0)
    scaled = torch.randn(16, 300, generator=gen) * 3
    top_k = torch.randint(1, 350, (16,), generator=gen)
    top_k[0], top_k[1] = -1, 1
    top_p = torch.rand(16, generator=gen)
    top_p[0], top_p[2], top_p[3] = 1.0, 1.0, 1e-6
    engine_k = torch.where(top_k > 0, top_k, torch.full_like(top_k, 300))
    engine_kept = torch.isfinite(filter_top_k_top_p(scaled, engine_k, top_p))
    kept = kept_tokens(scaled, top_k, top_p)
    assert torch.equal(kept, engine_kept)
    assert int(kept[0].sum()) == 300 and int(kept[1].sum()) == 1 and int(kept[3].sum()) == 1


SAMPLING = SamplingParams(temperature=1.0, top_k=40, top_p=0.7, max_new_tokens=10, seed=3)


async def _episodes(path: str, num: int) -> list[Trajectory]:
    """Two sampled turns each, a masked tool reply between them, recorded as the rollout does."""
    engine = LocalEngine.load(path, device="cpu")
    try:
        return [await _episode(engine, i) for i in range(num)]
    finally:
        await engine.close()


async def _episode(engine: LocalEngine, i: int) -> Trajectory:
    rec = EpisodeRecord(Task(f"t{i}", {}), "g", f"e{i}")
    rec.add_prompt([1, 50 + i, 60, 70, 80])
    for turn in range(2):
        sampling = dataclasses.replace(SAMPLING, seed=10 * i + turn)
        completion = await engine.generate(list(rec.token_ids), sampling)
        rec.add_sampled(completion, "", sampling)
        if turn == 0:
            rec.add_observation([90, 91, 92])
    rec.reward = float(i % 2)
    return rec.finish((EpisodeStatus.COMPLETED, StatusReason.DONE))


def _gaps(backend: TorchBackend, trajectories: list[Trajectory]) -> torch.Tensor:
    """|trainer logprob - rollout logprob| over every sampled token."""
    batch: TrainBatch = build_train_batches(
        [trajectories], AlgoConfig(), max_tokens_per_micro_batch=4096, pad_id=0
    )[0]
    backend.compute_logprobs(batch)
    gaps = []
    for mb in batch.micro_batches():
        assert mb.old_logprobs is not None
        is_loss = mb.loss_mask > 0
        gaps.append((mb.old_logprobs - mb.rollout_logprobs)[is_loss].abs())
    return torch.cat(gaps)


def test_a_truncated_rollout_matches_the_trainers_replayed_logprobs(tiny_model_path: str):
    trajectories = asyncio.run(_episodes(tiny_model_path, 4))
    turns = [turn for t in trajectories for turn in t.turns]
    assert all(t.is_logprob_truncated and (t.top_k, t.top_p) == (40, 0.7) for t in turns)
    backend = TorchBackend(tiny_model_path, TrainConfig(), AlgoConfig(), device="cpu")
    backend.setup()
    replayed = _gaps(backend, trajectories)
    # The same tokens, the trainer told nothing of the truncation: the whole softmax.
    untruncated = _gaps(
        backend,
        [
            dataclasses.replace(
                t, turns=[dataclasses.replace(u, is_logprob_truncated=False) for u in t.turns]
            )
            for t in trajectories
        ],
    )
    assert replayed.numel() == untruncated.numel() == sum(t.num_sampled for t in trajectories)
    assert float(replayed.max()) < 1e-4
    # Untruncated, each logprob is off by the log of the mass the filter kept.
    assert float(untruncated.min()) > 100 * float(replayed.max())


@pytest.mark.parametrize("is_entropy_trained", [False, True])
def test_replayed_logprobs_have_finite_gradients_and_entropy(is_entropy_trained: bool):
    """Dropped tokens sit at -inf: the entropy treats 0 * log 0 as 0, gradients stay finite."""
    from agentrl.trainer.logprobs import chunked_logprobs

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 8, generator=gen, requires_grad=True)
    weight = torch.randn(20, 8, generator=gen, requires_grad=True)
    target = (hidden @ weight.T).argmax(-1).detach()  # sampled tokens are kept: the top ones
    top_k, top_p = torch.tensor([-1, 1, 3, 5, -1, 2]), torch.tensor([1.0, 1.0, 0.5, 1.0, 0.3, 1.0])
    lp, ent = chunked_logprobs(
        hidden,
        weight,
        target,
        chunk_size=4,
        top_k=top_k,
        top_p=top_p,
        is_entropy_trained=is_entropy_trained,
    )
    (lp.sum() + ent.sum()).backward()
    lp, ent = lp.detach(), ent.detach()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    assert float(ent[1]) == pytest.approx(0.0, abs=1e-6)  # top-k 1: one token, no entropy
    full, _ = chunked_logprobs(hidden.detach(), weight.detach(), target)
    assert float(lp[0]) == pytest.approx(float(full[0]))  # filter off: the whole softmax
    assert bool((lp[2:] >= full[2:] - 1e-6).all())  # renormalised over fewer tokens
