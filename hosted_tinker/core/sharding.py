"""How a batch is split over data-parallel replicas and put back together: pure functions, used
by the server (which sends each replica its shard) and by the plans' reference tests."""

from __future__ import annotations

import dataclasses

import numpy as np

from hosted_tinker.core.types import ForwardBackwardBatch, ForwardBackwardResult, RequestFailed


def shard_by_tokens(lengths: list[int], ranks: int) -> list[list[int]]:
    """Datum indices per rank, balanced by token count: longest first, each onto the rank with
    the fewest tokens so far (ties: the lowest rank). A shard keeps the batch's order; a rank
    may get none."""
    load = [0] * ranks
    shards: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shards[rank].append(i)
        load[rank] += lengths[i]
    return [sorted(shard) for shard in shards]


def shard_batch(batch: ForwardBackwardBatch, shards: list[list[int]]) -> list[ForwardBackwardBatch]:
    return [dataclasses.replace(batch, data=[batch.data[i] for i in shard]) for shard in shards]


def merge_results(results: list[ForwardBackwardResult], shards: list[list[int]]) -> ForwardBackwardResult:
    """The ranks' results as one: per-datum arrays back in batch order, losses, metric sums and
    routed-token counts summed."""
    n = sum(len(s) for s in shards)
    logprobs: list[np.ndarray | None] = [None] * n
    elementwise: list[np.ndarray | None] = [None] * n
    for result, shard in zip(results, shards, strict=True):
        for i, lp, terms in zip(shard, result.logprobs, result.elementwise_loss, strict=True):
            logprobs[i], elementwise[i] = lp, terms
    metrics: dict[str, float] = {}
    for result in results:
        for key, value in result.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value
    routed = [r.routed for r in results if r.routed is not None]  # each replica's tokens: they add up
    return ForwardBackwardResult(
        every(logprobs),
        sum(r.loss_sum for r in results),
        elementwise,
        metrics,
        sum(routed[1:], routed[0]) if routed else None,
    )


def every(per_datum: list[np.ndarray | None]) -> list[np.ndarray]:
    """``per_datum`` once every datum has its array (the shards cover the batch)."""
    missing = [i for i, a in enumerate(per_datum) if a is None]
    if missing:
        raise ValueError(f"no result for datums {missing}")
    return [a for a in per_datum if a is not None]


def merge_many(
    replies: list[ForwardBackwardResult | RequestFailed], shards: list[list[int]], ranks_per_replica: int
) -> ForwardBackwardResult | RequestFailed:
    """One request's replies from every rank of a joint pass (consecutive ranks form a replica),
    as one: its failure where it failed (the failing rank's own, rather than a peer's report of
    it), else the replicas' results merged."""
    failed = [r for r in replies if isinstance(r, RequestFailed)]
    if failed:
        return next((f for f in failed if f.kind != "peer_failed"), failed[0])
    return merge_results(replies[::ranks_per_replica], shards)  # type: ignore[arg-type]
