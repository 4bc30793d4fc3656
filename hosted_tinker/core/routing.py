"""What the service reports of a mixture-of-experts model's routing with every forward_backward:
the five metrics the SDK documents on ``ForwardBackwardOutput.metrics``, computed here over the
request's tokens from how many each routed expert of each layer received (summed over
micro-batches and data-parallel replicas, so the figures do not depend on how a batch was cut).

Per layer, with ``c_e`` the token-expert assignments of expert ``e`` and ``p = Σ c_e / E`` the
perfect balance: the fraction of experts with a token, the fraction with more than ``p``,
``(max c - p) / p`` and ``(min c - p) / p``; averaged over the layers (``:mean``) or their
largest (``e_max_violation:max``).
"""

from __future__ import annotations

import numpy as np


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
