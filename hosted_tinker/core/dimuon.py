"""Dimuon: Muon for LoRA matrices, with a diagonal (row and column) preconditioner.

Tinker documents Dimuon only by its knobs (``DimuonParams``): a learning rate applied to a
direction of Frobenius norm √rank, a rank correction relative to rank 32, β1 momentum, a damping
that smooths the row and column preconditioner, and an internal matrix-sign iteration. Its
exact update is not published; this is ours, written so that each knob means what its
documentation says. For one LoRA matrix ``W`` (``(r, in)`` for ``lora_A``, ``(out, r)`` for
``lora_B``) with gradient ``G`` (already clipped with the others to ``grad_clip_norm``):

    M  ← β1·M + (1 − β1)·G                                    momentum, the only state
    ρ_i = mean_j M_ij²,  γ_j = mean_i M_ij²                  row and column energies of M
                                                             scaled to mean 1 (mean ρ = 1)
    X_ij = M_ij · (ρ_i + δ·mean ρ + ε)^-¼ · (γ_j + δ·mean γ + ε)^-¼
    O  = msign(X)                                            5 Newton–Schulz steps (below)
    W  ← W − η · (32 / r)^e · √r · O / ‖O‖_F

with ``δ = damping`` (large δ: plain Muon; small δ: rows and columns fully equalised),
``e = rank_lr_correction_exponent`` and ``r`` the adapter's rank. The direction has Frobenius
norm exactly √r whatever the iteration leaves of the singular values, so the step's size is
``η·(32/r)^e·√r``: with the default ``e = ½`` it is ``η·√32`` at every rank. Because the
direction is normalised, momentum needs no bias correction. A zero momentum gives a zero step.

Everything is computed in float64 (LoRA matrices are small: the iteration works on the
``r × r`` Gram side), so the update does not depend on the parameter dtype or the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

RANK_REFERENCE = 32  # the rank at which the rank correction is 1
NS_STEPS = 5
# Keller Jordan's quintic Newton–Schulz coefficients (Muon): they push every singular value of
# a matrix of spectral norm ≤ 1 into roughly [0.7, 1.2] in five steps.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-12  # normalisation epsilon: keeps a zero momentum a zero step, never a NaN


def precondition(m: Tensor, damping: float) -> Tensor:
    """``m`` (2-D) scaled by the damped inverse fourth roots of its row and column energies.
    ``m`` is first brought to unit mean energy, so that ``EPS`` is negligible at any scale of the
    gradients (the result, like the direction, does not depend on that scale)."""
    m = m / (m.square().mean().sqrt() + 1e-300)
    sq = m.square()
    rows, cols = sq.mean(dim=1), sq.mean(dim=0)
    row_scale = (rows + damping * rows.mean() + EPS).pow(-0.25)
    col_scale = (cols + damping * cols.mean() + EPS).pow(-0.25)
    return m * row_scale[:, None] * col_scale[None, :]


def matrix_sign(x: Tensor, steps: int = NS_STEPS) -> Tensor:
    """An approximation of ``U Vᵀ`` for ``x = U Σ Vᵀ`` by the quintic Newton–Schulz iteration,
    on the smaller Gram side (``x`` is transposed so that it has no more rows than columns)."""
    a, b, c = NS_COEFFICIENTS
    tall = x.shape[0] > x.shape[1]
    y = x.T if tall else x
    y = y / (torch.linalg.matrix_norm(y) + EPS)  # spectral norm ≤ Frobenius norm ≤ 1
    for _ in range(steps):
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y.T if tall else y


def direction(m: Tensor, *, rank: int, damping: float) -> Tensor:
    """The unit-free update direction of one matrix: Frobenius norm √rank (zero for zero ``m``).
    A stack of matrices ``(E, rows, cols)`` (one LoRA per routed expert) is that many matrices,
    each its own direction: an expert no token reached has zero momentum and does not move."""
    if m.dim() == 3:
        return torch.stack([direction(one, rank=rank, damping=damping) for one in m])
    o = matrix_sign(precondition(m.double(), damping))
    return o * (rank**0.5 / (torch.linalg.matrix_norm(o) + EPS))


def rank_correction(rank: int, exponent: float) -> float:
    """The factor on the learning rate: ``(32 / rank) ** exponent`` (1 at rank 32 or exponent 0)."""
    return (RANK_REFERENCE / rank) ** exponent
