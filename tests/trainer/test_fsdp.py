"""Data parallelism: one optimizer step on 2 FSDP2 ranks (gloo, CPU) gives the 1-rank update, the
same metrics and the same exported weights; checkpoints reshard 1 -> 2 and 2 -> 1 ranks."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainer.batch import build_train_batches
from agentrl.trainer.torch_backend import TorchBackend
from agentrl.weights.export import full_tensor

WORLD = 2
MAX_REL_DIFF = 1e-5  # fp32: only the order of float sums may differ between 1 and 2 ranks
# Gradients sit at fp32's noise floor: on ONE rank, another micro-batch split moves them by 6e-6.
GRAD_REL_DIFF = 5e-5
PLAIN = AlgoConfig()
# Per-sequence means (GSPO ratio, seq_mean_* aggregation), entropy and KL terms, and three optimizer
# steps of 3, 3 and 1 sequences: on 2 ranks the last step leaves one rank only an empty micro-batch.
SEQ_MEAN = AlgoConfig(
    policy_loss="gspo",
    loss_agg_mode="seq_mean_token_mean",
    eps_clip=0.2,
    entropy_coef=0.01,
    use_kl_loss=True,
    kl_loss_coef=0.1,
    use_tis=True,
)
PROBE_IDS = [5, 9, 17, 33, 8, 41, 12, 7, 60, 3]
# Adam's first update is lr * g / (|g| + eps): with the default eps 1e-8 an element whose gradient
# is ~1e-8 moves by anything up to lr on float noise alone (on ONE rank, merely changing the
# micro-batch split moves such weights by 4e-4 relative). A larger eps keeps the update a smooth
# function of the gradient, so comparing weights compares the gradients the ranks summed.
ADAM_EPS = 1e-4


def _backend(model_path: str, algo: AlgoConfig) -> TorchBackend:
    backend = TorchBackend(model_path, TrainConfig(lr=1e-3), algo, device="cpu", temperature=0.7)
    backend.setup()  # loads (and shards) the model, creating the optimizer
    assert backend.optimizer is not None
    backend.optimizer.param_groups[0]["eps"] = ADAM_EPS
    return backend


def _grads(backend: TorchBackend) -> dict[str, torch.Tensor]:
    """The last optimizer step's gradient, whole (gathered from the shards under FSDP)."""
    return {
        n: full_tensor(p.grad).clone()
        for n, p in backend.model.named_parameters()
        if p.grad is not None
    }


def _weights(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in backend.export_weights(64 * 1024) for n, t in bucket}


def _train(
    backend: TorchBackend, groups: list, algo: AlgoConfig, rank: int, dp_size: int, **kw: Any
) -> dict[str, float]:
    batches = build_train_batches(
        groups, algo, pad_id=backend.pad_id, dp_size=dp_size, max_tokens_per_micro_batch=24, **kw
    )
    return backend.train_step(batches[rank])


def _run(model_path: str, groups: list, ckpt: Path, rank: int, dp_size: int) -> dict[str, Any]:
    """Everything a rank does (the 1-rank reference too); returns what the test compares."""
    out: dict[str, Any] = {}
    a = _backend(model_path, PLAIN)
    out["metrics"] = _train(a, groups, PLAIN, rank, dp_size)
    out["weights"] = _weights(a)
    out["grads"] = _grads(a)
    out["probe"] = a.sequence_logprobs(PROBE_IDS, 3)
    a.save(ckpt / f"dp{dp_size}")
    # Resume from the checkpoint written with the *other* rank count, then take one more step.
    other = ckpt / ("dp1" if dp_size > 1 else f"dp{WORLD}")
    if other.exists():
        b = _backend(model_path, PLAIN)
        b.load(other)
        out["resumed_weights"] = _weights(b)
        out["resumed_metrics"] = _train(b, groups[::-1], PLAIN, rank, dp_size)
        out["resumed_next_weights"] = _weights(b)
    out["next_metrics"] = _train(a, groups[::-1], PLAIN, rank, dp_size)
    out["next_weights"] = _weights(a)
    c = _backend(model_path, SEQ_MEAN)
    out["seq_mean_metrics"] = _train(c, groups, SEQ_MEAN, rank, dp_size, global_batch_size=3)
    out["seq_mean_weights"] = _weights(c)
    return out


def _rank_main(rank: int, port: int, model_path: str, groups: list, ckpt: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    result = _run(model_path, groups, ckpt, rank, WORLD)
    torch.save(result, ckpt / f"rank{rank}.pt")
    dist.barrier()
    # Skip gloo's teardown: destroy_process_group (or its absence at exit) can SIGABRT on gloo.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _assert_same_weights(got: dict, want: dict, max_rel_diff: float = MAX_REL_DIFF) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        assert got[name].shape == w.shape, name
        assert _max_rel_diff(got[name], w) <= max_rel_diff, name


# How the batch was cut, which depends on the rank count by design.
LAYOUT_METRICS = ("num_micro_batches", "num_empty_micro_batches")


def _assert_same_metrics(got: dict, want: dict, *, rel: float = 1e-5, abs: float = 1e-7) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if k in LAYOUT_METRICS:
            continue
        assert got[k] == pytest.approx(v, rel=rel, abs=abs), k


def _assert_close_metrics(got: dict, want: dict) -> None:
    """Metrics of a step after an update: the weights then differ by float noise (<= 1e-6), which
    differences like approx_kl = mean(old - new logprob) amplify."""
    _assert_same_metrics(got, want, rel=1e-4, abs=1e-6)


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory) -> tuple[dict, list[dict], dict]:
    """(1-rank results, each of the 2 ranks' results, init weights); 1 rank runs first, so the
    2 ranks resume from its checkpoint, then 1 rank resumes from theirs."""
    from tests.trainer.conftest import make_groups

    groups = make_groups(num_groups=2, group_size=4, seed=11)
    groups[1] = groups[1][:3]  # 7 sequences: uneven over 2 ranks
    ckpt = tmp_path_factory.mktemp("fsdp_ckpt")
    torch.manual_seed(0)
    initial = _weights(_backend(tiny_model_path, PLAIN))
    single = _run(tiny_model_path, groups, ckpt, rank=0, dp_size=1)
    mp.spawn(_rank_main, args=(_free_port(), tiny_model_path, groups, ckpt), nprocs=WORLD)
    ranks = [torch.load(ckpt / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    # 2 -> 1: a fresh single rank resumes from the 2-rank checkpoint.
    resumed = _backend(tiny_model_path, PLAIN)
    resumed.load(ckpt / f"dp{WORLD}")
    single["resumed_weights"] = _weights(resumed)
    single["resumed_metrics"] = _train(resumed, groups[::-1], PLAIN, 0, 1)
    single["resumed_next_weights"] = _weights(resumed)
    single["hf_dir"] = ckpt / f"dp{WORLD}"
    return single, ranks, initial


def test_two_ranks_take_the_one_rank_step(runs):
    single, ranks, initial = runs
    moved = max(_max_rel_diff(single["weights"][n], w) for n, w in initial.items())
    assert moved > 100 * MAX_REL_DIFF  # lr 1e-3 visibly moved the weights
    for result in ranks:  # every rank exports the whole, identical weights
        _assert_same_weights(result["grads"], single["grads"], GRAD_REL_DIFF)
        _assert_same_weights(result["weights"], single["weights"])
        _assert_same_metrics(result["metrics"], single["metrics"])
        assert result["probe"] == pytest.approx(single["probe"], rel=1e-5, abs=1e-6)
    for name in single["weights"]:
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
    assert single["metrics"]["grad_norm"] > 0 and single["metrics"]["num_micro_batches"] > 1


def test_per_sequence_losses_kl_and_an_empty_rank_do_not_depend_on_the_rank_count(runs):
    single, ranks, _ = runs
    assert single["seq_mean_metrics"]["num_optimizer_steps"] == 3.0
    assert ranks[0]["seq_mean_metrics"]["num_empty_micro_batches"] >= 1.0
    for result in ranks:
        _assert_same_weights(result["seq_mean_weights"], single["seq_mean_weights"])
        _assert_close_metrics(result["seq_mean_metrics"], single["seq_mean_metrics"])


def test_checkpoints_reshard_between_rank_counts(runs):
    from transformers import AutoModelForCausalLM

    single, ranks, _ = runs
    # 1 -> 2 (ranks loaded dp1) and 2 -> 1 (single loaded dp2): the weights come back, and the
    # next step, which reads the optimizer state, matches the uninterrupted run.
    for result in [*ranks, single]:
        _assert_same_weights(result["resumed_weights"], single["weights"])
        _assert_close_metrics(result["resumed_metrics"], single["next_metrics"])
        _assert_same_weights(result["resumed_next_weights"], single["next_weights"])
    for result in ranks:
        _assert_same_weights(result["next_weights"], single["next_weights"])
    # Rank 0 of 2 wrote an HF copy that transformers loads.
    hf = AutoModelForCausalLM.from_pretrained(str(single["hf_dir"]))
    want = single["weights"]["model.embed_tokens.weight"]
    assert _max_rel_diff(hf.model.embed_tokens.weight.detach(), want) <= MAX_REL_DIFF
