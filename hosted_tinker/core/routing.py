"""What the service reports of a mixture-of-experts model's routing with every forward_backward:
the five metrics the SDK documents on ``ForwardBackwardOutput.metrics``, computed here over the
request's tokens from how many each routed expert of each layer received (summed over
micro-batches and data-parallel replicas, so the figures do not depend on how a batch was cut).

Per layer, with ``c_e`` the token-expert assignments of expert ``e`` and ``p = Σ c_e / E`` the
perfect balance: the fraction of experts with a token, the fraction with more than ``p``,
``(max c - p) / p`` and ``(min c - p) / p``; averaged over the layers (``:mean``) or their
largest (``e_max_violation:max``).

With routing replay (``rank.routing_replay``), two more once the request named recorded
sequences: the fraction of its (token, layer) routings taken from the sampler's record
(``routing_replayed:mean``), and of those, the fraction the learner's router would have chosen
otherwise (``routing_replay_changed:mean``: how much of the sampler-learner gap was routing).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A recorded routing (``rank.routing_replay``): per token and MoE layer the experts the sampler
# chose, as this dtype (every family has fewer than 32,768 experts), NO_EXPERT where there is
# no record (the last sampled token, never fed back; a position no sampler saw).
RECORD_DTYPE = "int16"
NO_EXPERT = -1


@dataclass(frozen=True)
class Routed:
    """A request's routing on a mixture-of-experts model, summed over its micro-batches and
    replicas: tokens each expert of each layer received, int64 ``(layers, experts)``, and of
    its (token, layer) routings, how many there were, how many were replayed from the sampler's
    record and how many of those differ from the learner's own choice."""

    counts: np.ndarray
    routings: int = 0
    replayed: int = 0
    changed: int = 0

    def __add__(self, other: Routed) -> Routed:
        return Routed(
            self.counts + other.counts,
            self.routings + other.routings,
            self.replayed + other.replayed,
            self.changed + other.changed,
        )


def replay_metrics(routed: Routed) -> dict[str, float]:
    """The replay's two fractions (the module's docstring)."""
    return {
        "routing_replayed:mean": routed.replayed / routed.routings if routed.routings else 0.0,
        "routing_replay_changed:mean": routed.changed / routed.replayed if routed.replayed else 0.0,
    }


def routing_metrics(counts: np.ndarray) -> dict[str, float]:
    """The SDK's MoE metrics from ``counts`` ``(layers, experts)``: tokens each expert received.
    Layers that received no token (an empty request) are left out; none at all gives none."""
    counts = np.asarray(counts, dtype=np.float64)
    counts = counts[counts.sum(axis=1) > 0]
    if counts.size == 0:
        return {}
    perfect = counts.sum(axis=1) / counts.shape[1]
    max_violation = (counts.max(axis=1) - perfect) / perfect
    return {
        "e_frac_with_tokens:mean": float((counts > 0).mean(axis=1).mean()),
        "e_frac_oversubscribed:mean": float((counts > perfect[:, None]).mean(axis=1).mean()),
        "e_max_violation:mean": float(max_violation.mean()),
        "e_max_violation:max": float(max_violation.max()),
        "e_min_violation:mean": float(((counts.min(axis=1) - perfect) / perfect).mean()),
    }
