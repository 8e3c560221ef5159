"""Advantages over groups, status exclusion, group filtering, shifting and packing."""

from __future__ import annotations

import pytest

from agentrl.config import AlgoConfig
from agentrl.trainer.batch import (
    build_train_batches,
    compute_advantages,
    pack_first_fit_decreasing,
    split_balanced,
)
from agentrl.types import EpisodeStatus

ERROR, ABORTED = EpisodeStatus.ERROR, EpisodeStatus.ABORTED


@pytest.mark.parametrize(
    "estimator", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
)
def test_error_and_aborted_trajectories_leave_group_statistics_unchanged(traj, estimator):
    cfg = AlgoConfig(advantage_estimator=estimator)
    clean = [
        [traj([(2, 0)], reward=1.0, seed=1), traj([(3, 0)], reward=0.0, seed=2)],
        [traj([(1, 0)], reward=0.5, seed=3), traj([(2, 1), (1, 0)], reward=0.0, seed=4)],
    ]
    broken = [
        clean[0] + [traj([(2, 0)], reward=0.0, status=ERROR, seed=5)],
        [traj([(4, 0)], reward=0.0, status=ABORTED, seed=6)] + clean[1],
    ]
    a_clean, a_broken = compute_advantages(clean, cfg), compute_advantages(broken, cfg)
    assert a_broken[0][:2] == pytest.approx(a_clean[0])
    assert a_broken[1][1:] == pytest.approx(a_clean[1])
    assert a_broken[0][2] is None and a_broken[1][0] is None


@pytest.mark.parametrize(
    "estimator", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
)
def test_an_episode_in_several_segments_counts_once(traj, estimator):
    """An agent that rewrote its history leaves two segments of one episode (same episode_id and
    reward): the group's statistics see one episode, and both segments get its advantage."""
    cfg = AlgoConfig(advantage_estimator=estimator)
    whole = [
        traj([(4, 0)], reward=1.0, seed=1),
        traj([(3, 0)], reward=0.0, seed=2),
        traj([(2, 0)], reward=0.0, seed=3),
    ]
    first, second = traj([(2, 0)], reward=1.0, seed=1), traj([(2, 0)], reward=1.0, seed=9)
    second.episode_id = first.episode_id  # one episode, two segments (4 sampled tokens in all)
    split = [first, second, *whole[1:]]
    a_whole, a_split = compute_advantages([whole], cfg)[0], compute_advantages([split], cfg)[0]
    assert a_split[0] == a_split[1] == pytest.approx(a_whole[0])
    assert a_split[2:] == pytest.approx(a_whole[1:])


def test_excluded_trajectories_are_counted_and_never_trained(traj):
    groups = [
        [
            traj([(2, 0)], reward=1.0, seed=1),
            traj([(2, 0)], reward=0.0, seed=2),
            traj([(5, 0)], reward=0.0, status=ERROR, seed=3),
            traj([(5, 0)], status=ABORTED, seed=4),
        ]
    ]
    batch = build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=0)[0]
    assert batch.metrics["batch/num_excluded_error"] == 1.0
    assert batch.metrics["batch/num_excluded_aborted"] == 1.0
    assert batch.metrics["batch/num_trained_sequences"] == 2.0
    assert batch.steps[0].num_loss_tokens == 4  # 2 + 2; the 10 excluded tokens count nowhere
    assert batch.steps[0].num_seqs == 2


def test_tensors_are_shifted_so_position_t_predicts_token_t_plus_1(traj):
    t0 = traj([(2, 2), (1, 3)], reward=1.0, prompt_len=3, seed=7)
    t1 = traj([(1, 0)], reward=0.0, prompt_len=2, seed=8)
    batch = build_train_batches(
        [[t0, t1]],
        AlgoConfig(normalize_advantage_std=False),
        max_tokens_per_micro_batch=1000,
        pad_id=0,
    )[0]
    (mb,) = batch.steps[0].micro_batches
    # FFD places the longer t0 first; t0 is cut after its last sampled token (index 7).
    n0 = 8
    assert mb.input_ids[0, :n0].tolist() == t0.token_ids[:n0]
    assert mb.target_ids[0, : n0 - 1].tolist() == t0.token_ids[1:n0]
    assert mb.loss_mask[0, :n0].tolist() == [0, 0, 1, 1, 0, 0, 1, 0]
    trained = mb.loss_mask[0, :n0] > 0
    assert mb.rollout_logprobs[0, :n0][trained].tolist() == pytest.approx(t0.logprobs)
    assert mb.advantages[0, :n0][trained].tolist() == [0.5, 0.5, 0.5]
    assert mb.advantages[0, :n0][~trained].abs().sum().item() == 0.0
    # Packed: t1 follows in the same row with positions restarting at 0.
    assert mb.position_ids[0].tolist() == list(range(n0)) + [0, 1, 2]
    assert mb.seq_index[0].tolist() == [0] * n0 + [1] * 3
    assert mb.seq_num_tokens.tolist() == [3.0, 1.0]
    assert mb.sample_indices == [0, 1]


def test_packing_respects_the_token_budget(groups_factory):
    groups = groups_factory(num_groups=4, group_size=4, seed=1)
    batch = build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=24, pad_id=0)[0]
    lengths = []
    for mb in batch.micro_batches():
        assert mb.input_ids.shape[0] == 1
        assert mb.num_tokens <= 24 or len(mb.sample_indices) == 1
        lengths.append(mb.num_tokens)
    assert sum(lengths) == batch.metrics["batch/num_tokens"]  # packed rows carry no padding
    indices = sorted(i for mb in batch.micro_batches() for i in mb.sample_indices)
    assert indices == list(range(16))


def test_global_batch_size_splits_optimizer_steps_with_their_own_denominators(groups_factory):
    groups = groups_factory(num_groups=3, group_size=4, seed=3)
    batch = build_train_batches(
        groups, AlgoConfig(), max_tokens_per_micro_batch=30, pad_id=0, global_batch_size=5
    )[0]
    assert [s.num_seqs for s in batch.steps] == [5, 5, 2]
    for step in batch.steps:
        assert step.num_loss_tokens == sum(int(mb.loss_mask.sum()) for mb in step.micro_batches)


def test_first_fit_decreasing():
    bins = pack_first_fit_decreasing([5, 9, 3, 7, 1, 12], 12)
    assert bins == [[5], [1, 2], [3, 0], [4]]  # 12 | 9+3 | 7+5 | 1


def test_inconsistent_trajectory_is_named(traj):
    bad = traj([(2, 0)], reward=1.0, seed=1)
    bad.logprobs = bad.logprobs[:1]
    with pytest.raises(ValueError, match="2 trained tokens but 1 logprobs"):
        build_train_batches(
            [[bad, traj([(1, 0)], seed=2)]], AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=0
        )[0]


def test_status_may_arrive_as_a_string(traj):
    t = traj([(1, 0)], reward=1.0)
    t.status = "error"
    assert compute_advantages([[t]], AlgoConfig()) == [[None]]
    batch = build_train_batches([[t]], AlgoConfig(), max_tokens_per_micro_batch=8, pad_id=0)[0]
    assert batch.steps == [] and batch.metrics["batch/num_excluded_error"] == 1.0


def _sequence_lengths(step) -> list[int]:
    return [
        int((mb.seq_index[0] == k).sum())
        for mb in step.micro_batches
        for k in range(len(mb.sample_indices))
    ]


def test_ranks_split_each_step_by_tokens_and_keep_its_global_denominators(groups_factory):
    groups = groups_factory(num_groups=3, group_size=4, seed=5)
    (whole,) = build_train_batches(
        groups, AlgoConfig(), max_tokens_per_micro_batch=20, pad_id=0, global_batch_size=7
    )
    ranks = build_train_batches(
        groups,
        AlgoConfig(),
        max_tokens_per_micro_batch=20,
        pad_id=0,
        global_batch_size=7,
        dp_size=3,
    )
    assert len(ranks) == 3
    for s, step in enumerate(whole.steps):
        per_rank = [batch.steps[s] for batch in ranks]
        # Every rank: the same micro-batch count (collectives stay in step), the global counts.
        assert len({len(r.micro_batches) for r in per_rank}) == 1
        assert {(r.num_loss_tokens, r.num_seqs) for r in per_rank} == {
            (step.num_loss_tokens, step.num_seqs)
        }
        # Each sequence of the step on exactly one rank, loss tokens conserved.
        indices = sorted(i for r in per_rank for mb in r.micro_batches for i in mb.sample_indices)
        assert indices == sorted(i for mb in step.micro_batches for i in mb.sample_indices)
        assert sum(float(mb.loss_mask.sum()) for r in per_rank for mb in r.micro_batches) == float(
            step.num_loss_tokens
        )
        # Balanced: rank token totals differ by at most the longest sequence.
        totals = [sum(_sequence_lengths(r)) for r in per_rank]
        assert max(totals) - min(totals) <= max(_sequence_lengths(step))
    assert all(batch.metrics == ranks[0].metrics for batch in ranks)  # global, on every rank
    assert ranks[0].metrics["batch/num_trained_sequences"] == 12.0


def test_a_rank_without_sequences_gets_an_empty_micro_batch(traj):
    groups = [[traj([(3, 0)], reward=1.0, seed=1), traj([(2, 1)], reward=0.0, seed=2)]]
    *busy, idle = build_train_batches(
        groups, AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=7, dp_size=3
    )
    assert [len(b.steps[0].micro_batches[0].sample_indices) for b in busy] == [1, 1]
    (step,) = idle.steps
    assert step.num_seqs == 2 and step.num_loss_tokens == 5  # the step's, not this rank's
    (mb,) = step.micro_batches
    assert mb.input_ids.tolist() == [[7]] and mb.loss_mask.sum() == 0
    assert mb.sample_indices == [] and mb.seq_num_tokens.tolist() == [0.0]
    assert idle.metrics["batch/num_micro_batches"] == 2.0
    assert idle.metrics["batch/num_empty_micro_batches"] == 1.0


def test_split_balanced_puts_the_longest_first_on_the_lightest_rank():
    assert split_balanced([5, 9, 3, 7, 1], 2) == [[1, 2, 4], [0, 3]]  # 9+3+1 | 7+5
    assert split_balanced([4], 3) == [[0], [], []]


def test_dp_size_must_be_positive(groups_factory):
    with pytest.raises(ValueError, match="dp_size=0 must be >= 1"):
        build_train_batches(
            groups_factory(1, 2), AlgoConfig(), max_tokens_per_micro_batch=8, pad_id=0, dp_size=0
        )


def test_micro_batch_size_caps_the_sequences_per_micro_batch(groups_factory):
    groups = groups_factory(num_groups=2, group_size=4, seed=3)
    kw = dict(max_tokens_per_micro_batch=10_000, pad_id=0)
    (unbounded,) = build_train_batches(groups, AlgoConfig(), **kw)
    (capped,) = build_train_batches(groups, AlgoConfig(), micro_batch_size=3, **kw)
    assert [len(mb.sample_indices) for mb in unbounded.micro_batches()] == [8]
    assert [len(mb.sample_indices) for mb in capped.micro_batches()] == [3, 3, 2]
    assert pack_first_fit_decreasing([1, 1, 1], 100, max_seqs=2) == [[0, 1], [2]]
