"""Dimuon's update (``core.dimuon``, ``rank.optimizers.Dimuon``) against an independent float64
reference written from the formula in docs/compatibility.md with NumPy: the iteration is run on the other Gram
side (``y ← a·y + y·(b·G + c·G²)``, ``G = yᵀy``), the energies with explicit loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hosted_tinker.core import dimuon
from hosted_tinker.core.types import AdamParams, DimuonParams
from hosted_tinker.rank.optimizers import Dimuon

pytestmark = pytest.mark.fast


def ref_direction(m: np.ndarray, rank: int, damping: float) -> np.ndarray:
    rows, cols = m.shape
    m = m / np.sqrt((m**2).mean())  # unit mean energy
    rho = np.array([sum(m[i, j] ** 2 for j in range(cols)) / cols for i in range(rows)])
    gamma = np.array([sum(m[i, j] ** 2 for i in range(rows)) / rows for j in range(cols)])
    x = np.empty_like(m)
    for i in range(rows):
        for j in range(cols):
            x[i, j] = m[i, j] * (rho[i] + damping * rho.mean() + 1e-12) ** -0.25
            x[i, j] *= (gamma[j] + damping * gamma.mean() + 1e-12) ** -0.25
    a, b, c = 3.4445, -4.7750, 2.0315
    y = x / (np.linalg.norm(x) + 1e-12)
    wide = rows <= cols  # iterate on the larger Gram side when wide, the smaller when tall
    for _ in range(5):
        if wide:  # y (b·G + c·G²) with G = yᵀy: the same polynomial in y, from the right
            g = y.T @ y
            y = a * y + y @ (b * g + c * g @ g)
        else:
            g = y @ y.T
            y = a * y + (b * g + c * g @ g) @ y
    return y * np.sqrt(rank) / (np.linalg.norm(y) + 1e-12)


@pytest.mark.parametrize("shape", [(8, 24), (40, 8), (8, 8)])
@pytest.mark.parametrize("damping", [0.1, 1e-3, 10.0])
def test_direction_matches_the_float64_reference(shape, damping):
    rng = np.random.default_rng(sum(shape))
    m = rng.normal(size=shape) * rng.uniform(0.1, 3.0, size=(shape[0], 1))  # uneven rows
    got = dimuon.direction(torch.from_numpy(m), rank=8, damping=damping).numpy()
    np.testing.assert_allclose(got, ref_direction(m, 8, damping), rtol=1e-9, atol=1e-12)


def test_direction_has_frobenius_norm_sqrt_rank_and_ignores_scale():
    m = torch.randn(16, 64, dtype=torch.float64)
    d = dimuon.direction(m, rank=16, damping=0.1)
    assert torch.linalg.matrix_norm(d).item() == pytest.approx(4.0, rel=1e-12)
    for scale in (1e-9, 1e-4, 1e6):
        torch.testing.assert_close(dimuon.direction(m * scale, rank=16, damping=0.1), d, rtol=1e-9, atol=1e-12)
    assert torch.count_nonzero(dimuon.direction(torch.zeros(16, 64), rank=16, damping=0.1)) == 0


def test_large_damping_is_muon_close_to_the_polar_factor():
    m = torch.randn(8, 48, dtype=torch.float64)
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    polar = u @ vh  # Frobenius norm √8
    d = dimuon.direction(m, rank=8, damping=1e9)
    cosine = (d * polar).sum() / (torch.linalg.matrix_norm(d) * torch.linalg.matrix_norm(polar))
    assert cosine > 0.97


def test_rank_correction():
    assert dimuon.rank_correction(32, 0.5) == 1.0
    assert dimuon.rank_correction(8, 0.5) == pytest.approx(2.0)
    assert dimuon.rank_correction(128, 1.0) == pytest.approx(0.25)
    assert dimuon.rank_correction(7, 0.0) == 1.0


class _Whole:  # one rank: matrices are already whole
    def whole(self, t, split_dim):
        return t

    def shard(self, full, split_dim):
        return full


def test_optimizer_steps_match_the_reference():
    """Three steps of changing gradients: momentum, rank correction, learning rate, every knob."""
    rng = np.random.default_rng(0)
    shapes, rank = [(4, 12), (20, 4)], 4
    start = [rng.normal(size=s) for s in shapes]
    params = [nn.Parameter(torch.tensor(w)) for w in start]
    opt = Dimuon(params, [None, None], rank, _Whole())
    steps = [
        DimuonParams(learning_rate=0.05, beta1=0.9),
        DimuonParams(learning_rate=0.02, beta1=0.5, damping=0.01, rank_lr_correction_exponent=1.0),
        DimuonParams(learning_rate=0.1, beta1=0.0, damping=3.0, rank_lr_correction_exponent=0.0),
    ]
    weights, momenta = [w.copy() for w in start], [np.zeros(s) for s in shapes]
    for params_t in steps:
        grads = [rng.normal(size=s) for s in shapes]
        for p, g in zip(params, grads, strict=True):
            p.grad = torch.tensor(g)
        opt.step(params_t)
        lr = params_t.learning_rate * (32 / rank) ** params_t.rank_lr_correction_exponent
        for i, g in enumerate(grads):
            momenta[i] = params_t.beta1 * momenta[i] + (1 - params_t.beta1) * g
            weights[i] = weights[i] - lr * ref_direction(momenta[i], rank, params_t.damping)
    for p, w in zip(params, weights, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-9, atol=1e-12)
        assert p.grad is None
    assert set(opt.state[params[0]]) == {"momentum"}


def test_a_parameter_without_gradient_is_left_alone():
    p, q = nn.Parameter(torch.ones(4, 8)), nn.Parameter(torch.ones(8, 4))
    opt = Dimuon([p, q], [None, None], 4, _Whole())
    q.grad = torch.randn(8, 4)
    opt.step(DimuonParams(learning_rate=0.1))
    assert torch.equal(p.detach(), torch.ones(4, 8)) and p not in opt.state
    assert not torch.equal(q.detach(), torch.ones(8, 4))
    with pytest.raises(AssertionError):
        opt.step(AdamParams())
