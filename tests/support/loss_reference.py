"""Independent references of the losses, in float64 (``ref_stable_reinforce``)."""

from __future__ import annotations

import numpy as np


def ref_stable_reinforce(lp, q, adv, sampled, c, beta):
    """Per token, written out by case: a prompt position (m = 0) is 0 with gradient 0; a sampled
    one is -w·A·lp + β(ρ - 1 - log ρ), with w = ρ below the cap (a constant: stop-gradient) and
    c above it, so d/dlp = -w·A + β(ρ - 1)."""
    terms, grad = np.zeros_like(lp), np.zeros_like(lp)
    for t in range(len(lp)):
        if sampled[t] == 0:
            continue
        rho = np.exp(lp[t] - q[t])
        w = rho if rho < c else c
        terms[t] = -w * adv[t] * lp[t] + beta * (rho - 1.0 - (lp[t] - q[t]))
        grad[t] = -w * adv[t] + beta * (rho - 1.0)
    return terms, grad
