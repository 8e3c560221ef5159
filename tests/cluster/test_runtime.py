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


def test_agentrl_serve_gets_the_kv_fraction_and_the_trainers_reserve():
    """engine.mem_fraction_static reaches the `agentrl serve` it launches (it was dropped), and
    a colocated engine leaves its rank's optimizer state out of the KV cache. (The Ray tests of
    tests/cluster/test_ray_train.py launch `agentrl serve` with these flags.)"""
    from agentrl.cluster.engine_group import ServerSpec, reserve_for, server_cmd
    from agentrl.cluster.placement import Placement

    spec = ServerSpec(index=0, model_path="m", device_ids=[1], use_gpu=True, use_sglang=False,
                      host="127.0.0.1", dtype="bfloat16", max_batch_size=8,
                      mem_fraction_static=0.65, sglang_args=[], log_dir=".", health_timeout_s=1,
                      reserve_bytes=3 * 2**30)  # fmt: skip
    cmd = server_cmd(spec, port=1234)
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.65"
    assert cmd[cmd.index("--reserve-gb") + 1] == "3.000"
    assert cmd[cmd.index("--device") + 1] == "cuda:1"
    colocated = Placement(num_bundles=2, trainer_bundles=[0, 1], engine_bundles=[[1], [0]],
                          is_colocated=True, use_gpu=True)  # fmt: skip
    assert [reserve_for(colocated, e, [10, 20]) for e in (0, 1)] == [20, 10]
    apart = Placement(num_bundles=2, trainer_bundles=[0], engine_bundles=[[1]],
                      is_colocated=False, use_gpu=True)  # fmt: skip
    assert reserve_for(apart, 0, [10]) == 0
