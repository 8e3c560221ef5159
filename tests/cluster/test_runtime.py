"""Pure parts of `RayRuntime`: which batch each trainer rank trains on."""

from __future__ import annotations

import pytest

from agentrl.cluster.runtime import batches_per_rank


def test_fsdp_ranks_take_one_batch_each():
    assert batches_per_rank(["b0", "b1", "b2"], [0, 1, 2]) == ["b0", "b1", "b2"]


def test_megatron_tp_and_pp_ranks_of_a_replica_share_its_batch():
    # 8 ranks, TP=2, PP=2, DP=2 in Megatron's order (TP fastest, then DP, then PP)
    dp_ranks = [0, 0, 1, 1, 0, 0, 1, 1]
    assert batches_per_rank(["a", "b"], dp_ranks) == ["a", "a", "b", "b", "a", "a", "b", "b"]


def test_a_batch_count_that_is_not_the_dp_size_is_refused():
    with pytest.raises(ValueError, match=r"3 batches for data-parallel ranks \[0, 1\]"):
        batches_per_rank(["a", "b", "c"], [0, 0, 1, 1])
