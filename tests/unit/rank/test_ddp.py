"""The unit tests of what tests/e2e/test_ddp.py tests end to end (no server here)."""

from __future__ import annotations

import numpy as np
import pytest

from hosted_tinker.core.config import parse_devices
from hosted_tinker.core.sharding import merge_many, merge_results, shard_by_tokens

pytestmark = pytest.mark.fast


def test_parse_devices():
    assert parse_devices("cpu") == ["cpu"]
    assert parse_devices("cpu:3") == ["cpu"] * 3
    assert parse_devices("cuda") == ["cuda:0"]
    assert parse_devices("cuda:2,0") == ["cuda:2", "cuda:0"]
    for bad in ("cpu:0", "cpu:x", "cuda:0,0", "cuda:a", "tpu:2", ""):
        with pytest.raises(ValueError, match="train devices"):
            parse_devices(bad)


def test_shards_balance_tokens_not_datums_and_keep_batch_order():
    lengths = [100, 3, 4, 5, 90, 2, 2]
    shards = shard_by_tokens(lengths, 2)
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    assert all(s == sorted(s) for s in shards)
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(lengths)  # the greedy bound
    assert loads == [104, 102]  # 100 + 4, then 90 + 5 + 3 + 2 + 2
    assert shard_by_tokens([7], 3) == [[0], [], []]  # fewer datums than ranks: empty shards
    assert shard_by_tokens([], 2) == [[], []]


def test_merge_puts_results_back_in_batch_order():
    shards = [[0, 3], [1, 2]]
    results = [
        _result([np.array([0.0]), np.array([3.0])], 1.5),
        _result([np.array([1.0]), np.array([2.0])], 2.0),
    ]
    merged = merge_results(results, shards)
    assert [float(lp[0]) for lp in merged.logprobs] == [0.0, 1.0, 2.0, 3.0] and merged.loss_sum == 3.5
    assert [float(t[0]) for t in merged.elementwise_loss] == [-0.0, -1.0, -2.0, -3.0]


def test_a_joint_pass_merges_each_request_over_replicas_and_names_the_failing_rank():
    """Four ranks, two replicas of two: a request's result is merged from each replica's first
    rank; its failure is the rank's own, not a peer's report of it."""
    from hosted_tinker.core.types import RequestFailed

    shards = [[0], [1]]
    ok = [_result([np.array([0.0])], 1.0), None, _result([np.array([1.0])], 2.0), None]
    merged = merge_many(ok, shards, ranks_per_replica=2)
    assert [float(lp[0]) for lp in merged.logprobs] == [0.0, 1.0] and merged.loss_sum == 3.0
    peer, own = RequestFailed("peer_failed", "another rank failed"), RequestFailed("user_error", "bad weights")
    assert merge_many([peer, peer, peer, own], shards, ranks_per_replica=2) == own


def _result(logprobs: list[np.ndarray], loss: float):
    from hosted_tinker.core.types import ForwardBackwardResult

    return ForwardBackwardResult(logprobs=logprobs, loss_sum=loss, elementwise_loss=[-lp for lp in logprobs])
