"""Unit tests of ``hosted_tinker.losses`` against an independent float64 numpy reference.

Every loss is checked for its value AND its gradient w.r.t. ``lp``. The reference gradients
are the hand-derived analytic formulas of protocol reference §7, written region by region
(which branch of the min is active, which side of the clip a ratio lies on) rather than by
re-implementing the min/clamp expressions, so the two computations are independent.

Inputs are random with fixed seeds and are built so that every region is populated with both
signs of the advantage, and no ratio lies within ``GAP`` of a clip threshold (no ties).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hosted_tinker.core.losses import LOSSES
from tests.support.loss_reference import ref_stable_reinforce

pytestmark = pytest.mark.fast

TOL = 1e-10
GAP = 0.02  # minimum distance between a ratio and a clip threshold


# ---- helpers --------------------------------------------------------------------------------


def run_loss(name: str, lp: np.ndarray, inputs: dict[str, np.ndarray], config: dict | None = None):
    """Run the project's loss in float64 torch; return (per-token terms, d Σterms / d lp) as numpy.

    The terms are what the client gets as ``elementwise_loss``; their sum is the datum's loss."""
    cfg = dict(LOSSES[name].config_defaults)
    cfg.update(config or {})
    lp_t = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    inputs_t = {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()}
    terms = LOSSES[name].fn(lp_t, inputs_t, cfg)
    assert terms.shape == lp_t.shape, "a loss returns one term per target"
    assert terms.dtype == torch.float64
    terms.sum().backward()
    assert lp_t.grad is not None
    return terms.detach().numpy().copy(), lp_t.grad.numpy().copy()


def assert_matches(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> None:
    """Per-token terms, their sum and the gradient all match the reference."""
    terms, grad = got
    ref_terms, ref_grad = want
    assert terms.shape == ref_terms.shape
    np.testing.assert_allclose(terms, ref_terms, rtol=TOL, atol=TOL)
    assert terms.sum() == pytest.approx(ref_terms.sum(), abs=TOL, rel=TOL)
    assert grad.shape == ref_grad.shape
    np.testing.assert_allclose(grad, ref_grad, rtol=TOL, atol=TOL)


def sample_ratios(rng: np.random.Generator, region: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per token: region -1 → r < lo, 0 → lo < r < hi, +1 → r > hi (all at least GAP away)."""
    u = rng.uniform(0.0, 1.0, size=region.shape)
    below = (lo - GAP) * (0.3 + 0.7 * u)  # in [0.3(lo-GAP), lo-GAP]
    inside = lo + GAP + (hi - lo - 2 * GAP) * u
    above = hi + GAP + (0.8 + hi) * u
    r = np.where(region < 0, below, np.where(region > 0, above, inside))
    assert np.all(r > 0)
    return r


def pg_case(
    seed: int, lo: float | np.ndarray, hi: float | np.ndarray, n_per_cell: int = 3
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Random (lp, q, A, r) with every (region, sign A) cell populated.

    Region "below lo" is only generated when lo leaves room for it (lo > 2·GAP).
    """
    rng = np.random.default_rng(seed)
    regions = [0, 1] + ([-1] if np.min(lo) > 2 * GAP else [])
    cells = [(reg, sign) for reg in regions for sign in (-1.0, 1.0)]
    region = np.repeat([c[0] for c in cells], n_per_cell)
    sign = np.repeat([c[1] for c in cells], n_per_cell)
    perm = rng.permutation(len(region))
    region, sign = region[perm], sign[perm]
    n = len(region)
    lo_a = np.broadcast_to(np.asarray(lo, dtype=np.float64), (n,))
    hi_a = np.broadcast_to(np.asarray(hi, dtype=np.float64), (n,))
    r = sample_ratios(rng, region, lo_a, hi_a)
    q = rng.normal(-1.5, 0.7, size=n)
    lp = q + np.log(r)
    adv = sign * rng.uniform(0.1, 2.0, size=n)
    # sanity: the generated data really exercises both clip sides / both advantage signs
    assert np.any(adv > 0) and np.any(adv < 0)
    assert np.any(r > hi_a)
    return lp, q, adv, np.exp(lp - q)


# ---- numpy references (value, gradient) -------------------------------------------------------


def ref_cross_entropy(lp, w):
    return -w * lp, -w


def ref_importance_sampling(lp, q, adv):
    r = np.exp(lp - q)
    return -r * adv, -adv * r


def ref_clipped_surrogate(ratio, adv, lo, hi):
    """-Σ min(ρ·A, clip(ρ)·A) for ρ with dρ/dlp = ρ, derived region by region.

    The clipped branch is the (strictly) smaller one exactly when ρ > hi with A > 0, or ρ < lo
    with A < 0; it is then constant in lp (gradient 0). Everywhere else the loss is -ρ·A and
    its gradient -A·ρ.
    """
    ratio, adv = np.broadcast_arrays(np.asarray(ratio, dtype=np.float64), adv)
    lo = np.broadcast_to(np.asarray(lo, dtype=np.float64), ratio.shape)
    hi = np.broadcast_to(np.asarray(hi, dtype=np.float64), ratio.shape)
    clipped_active = ((ratio > hi) & (adv > 0)) | ((ratio < lo) & (adv < 0))
    bound = np.where(ratio > hi, hi, lo)
    per_token = np.where(clipped_active, -bound * adv, -ratio * adv)
    grad = np.where(clipped_active, 0.0, -adv * ratio)
    return per_token, grad


def ref_ppo(lp, q, adv, lo, hi):
    return ref_clipped_surrogate(np.exp(lp - q), adv, lo, hi)


def ref_cispo(lp, q, adv, lo, hi):
    r = np.exp(lp - q)
    c = np.minimum(np.maximum(r, lo), hi)
    return -c * lp * adv, -c * adv


def ref_dro(lp, q, adv, beta):
    value = -(lp * adv - 0.5 * beta * (lp - q) ** 2)
    grad = -(adv - beta * (lp - q))
    return value, grad


def ref_gspo(lp, q, adv, mask, lo, hi):
    """GSPO-token: every ρ_t has the value s, and dρ_t/dlp_t = ρ_t (log s is stop-gradient)."""
    m = mask != 0
    log_s = float(np.mean(lp[m] - q[m])) if m.any() else 0.0
    s = np.full(lp.shape, np.exp(log_s))
    return ref_clipped_surrogate(s, adv, lo, hi)


# ---- LOSSES table -------------------------------------------------------------------------------


def test_documented_defaults():
    assert set(LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"}
    assert dict(LOSSES["stable_reinforce"].config_defaults) == {"clip_high_threshold": 2.0, "kl_coeff": 0.0}
    assert dict(LOSSES["ppo"].config_defaults) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert dict(LOSSES["cispo"].config_defaults) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert dict(LOSSES["gspo"].config_defaults) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert dict(LOSSES["dro"].config_defaults) == {"beta": 0.05}
    assert dict(LOSSES["cross_entropy"].config_defaults) == {}
    assert dict(LOSSES["importance_sampling"].config_defaults) == {}


def test_required_inputs_and_topk():
    assert LOSSES["cross_entropy"].required_inputs == () and LOSSES["cross_entropy"].input_defaults == {"weights": 1.0}
    assert LOSSES["cross_entropy"].allows_topk_targets
    for name in ("importance_sampling", "ppo", "cispo", "dro"):
        assert set(LOSSES[name].required_inputs) == {"logprobs", "advantages"}
        assert not LOSSES[name].allows_topk_targets
    assert set(LOSSES["gspo"].required_inputs) == {"logprobs", "advantages", "sequence_ratio_mask"}
    for name in ("ppo", "cispo", "gspo"):
        assert set(LOSSES[name].optional_inputs) == {"clip_low_threshold", "clip_high_threshold"}
    # stable_reinforce reads the sampler's log-probs from the server's record, never the client's
    sr = LOSSES["stable_reinforce"]
    assert sr.required_inputs == ("advantages",) and sr.optional_inputs == ("logprobs",)
    assert sr.needs_provenance and set(sr.recorded_inputs) == {"logprobs", "sampled_mask"}
    assert not any(LOSSES[name].needs_provenance for name in LOSSES if name != "stable_reinforce")


# ---- cross_entropy ------------------------------------------------------------------------------


def test_cross_entropy_binary_weights():
    rng = np.random.default_rng(1)
    lp = -rng.exponential(1.0, size=17)
    w = (rng.uniform(size=17) > 0.3).astype(np.float64)
    assert_matches(run_loss("cross_entropy", lp, {"weights": w}), ref_cross_entropy(lp, w))


def test_cross_entropy_negative_nonbinary_weights():
    # forward_backward_custom sends weights = -dL/dlp: any real numbers.
    rng = np.random.default_rng(2)
    lp = -rng.exponential(1.0, size=23)
    w = rng.normal(0.0, 3.0, size=23)
    assert np.any(w < 0) and np.any(np.abs(w) > 1)
    assert_matches(run_loss("cross_entropy", lp, {"weights": w}), ref_cross_entropy(lp, w))


def test_cross_entropy_topk():
    rng = np.random.default_rng(3)
    n, k = 9, 5
    lp = -rng.exponential(2.0, size=(n, k))
    w = rng.dirichlet(np.ones(k), size=n)  # soft distillation: teacher probabilities
    w[0] = 0.0
    w[1, :2] = [-0.5, 1.5]
    value, grad = run_loss("cross_entropy", lp, {"weights": w})
    assert grad.shape == (n, k)
    assert_matches((value, grad), ref_cross_entropy(lp, w))
    assert value.sum() == pytest.approx(-sum(w[t, j] * lp[t, j] for t in range(n) for j in range(k)), abs=TOL)


def test_cross_entropy_empty():
    lp = np.zeros(0)
    assert_matches(run_loss("cross_entropy", lp, {"weights": np.zeros(0)}), (np.zeros(0), np.zeros(0)))


# ---- importance_sampling ------------------------------------------------------------------------


def test_importance_sampling_is_unclipped():
    lp, q, adv, r = pg_case(10, 0.8, 1.2)
    assert np.any(r < 0.5) or np.any(r > 1.5)
    assert_matches(
        run_loss("importance_sampling", lp, {"logprobs": q, "advantages": adv}),
        ref_importance_sampling(lp, q, adv),
    )


def test_importance_sampling_on_policy_is_minus_sum_advantages():
    rng = np.random.default_rng(11)
    q = rng.normal(-1.0, 0.5, size=8)
    adv = rng.normal(size=8)
    value, grad = run_loss("importance_sampling", q.copy(), {"logprobs": q, "advantages": adv})
    assert value.sum() == pytest.approx(-adv.sum(), abs=TOL)
    np.testing.assert_allclose(grad, -adv, atol=TOL)


# ---- ppo ----------------------------------------------------------------------------------------


def test_ppo_defaults():
    lp, q, adv, r = pg_case(20, 0.8, 1.2)
    assert np.any(r < 0.8) and np.any((r > 0.8) & (r < 1.2))
    got = run_loss("ppo", lp, {"logprobs": q, "advantages": adv})
    assert_matches(got, ref_ppo(lp, q, adv, 0.8, 1.2))
    # the clip really bites: some gradients are exactly zero, and the result differs from IS
    assert np.sum(got[1] == 0.0) == 6  # (r > hi, A > 0) and (r < lo, A < 0), 3 tokens each
    assert got[0].sum() != pytest.approx(ref_importance_sampling(lp, q, adv)[0].sum(), abs=1e-3)


def test_ppo_custom_thresholds():
    lo, hi = 0.6, 1.5
    lp, q, adv, _ = pg_case(21, lo, hi)
    cfg = {"clip_low_threshold": lo, "clip_high_threshold": hi}
    got = run_loss("ppo", lp, {"logprobs": q, "advantages": adv}, cfg)
    assert_matches(got, ref_ppo(lp, q, adv, lo, hi))
    # the defaults would give a different answer on the same data
    assert got[0].sum() != pytest.approx(ref_ppo(lp, q, adv, 0.8, 1.2)[0].sum(), abs=1e-6)


def test_ppo_per_token_thresholds():
    rng = np.random.default_rng(22)
    n = 18  # 3 regions x 2 signs x 3
    lo = rng.uniform(0.5, 0.9, size=n)
    hi = rng.uniform(1.1, 1.6, size=n)
    lp, q, adv, _ = pg_case(23, lo, hi)
    inputs = {"logprobs": q, "advantages": adv, "clip_low_threshold": lo, "clip_high_threshold": hi}
    # per-token tensors take precedence over the scalar config
    got = run_loss("ppo", lp, inputs, {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01})
    assert_matches(got, ref_ppo(lp, q, adv, lo, hi))


def test_ppo_per_token_low_only():
    # only one of the two thresholds given per token; the other comes from the config
    rng = np.random.default_rng(24)
    lo = rng.uniform(0.5, 0.9, size=18)
    lp, q, adv, _ = pg_case(25, lo, 1.3)
    got = run_loss(
        "ppo", lp, {"logprobs": q, "advantages": adv, "clip_low_threshold": lo}, {"clip_high_threshold": 1.3}
    )
    assert_matches(got, ref_ppo(lp, q, adv, lo, 1.3))


# ---- cispo --------------------------------------------------------------------------------------


def test_cispo_defaults_one_sided():
    lo, hi = 0.0, 4.0
    lp, q, adv, r = pg_case(30, lo, hi)
    lp[:2] = q[:2] + np.log([0.05, 0.3])  # small ratios are NOT clipped by default
    assert np.any(r > 4.0) and adv[0] * adv[1] != 0
    got = run_loss("cispo", lp, {"logprobs": q, "advantages": adv})
    assert_matches(got, ref_cispo(lp, q, adv, lo, hi))


def test_cispo_custom_thresholds():
    lo, hi = 0.8, 1.2
    lp, q, adv, r = pg_case(31, lo, hi)
    assert np.any(r < lo) and np.any(r > hi)
    cfg = {"clip_low_threshold": lo, "clip_high_threshold": hi}
    got = run_loss("cispo", lp, {"logprobs": q, "advantages": adv}, cfg)
    assert_matches(got, ref_cispo(lp, q, adv, lo, hi))
    # the clipped weight is a stop-gradient: no token has a zero gradient, unlike ppo
    assert np.all(got[1] != 0.0)


def test_cispo_per_token_thresholds():
    rng = np.random.default_rng(32)
    lo = rng.uniform(0.5, 0.9, size=18)
    hi = rng.uniform(1.1, 1.6, size=18)
    lp, q, adv, _ = pg_case(33, lo, hi)
    inputs = {"logprobs": q, "advantages": adv, "clip_low_threshold": lo, "clip_high_threshold": hi}
    assert_matches(run_loss("cispo", lp, inputs), ref_cispo(lp, q, adv, lo, hi))


# ---- dro ----------------------------------------------------------------------------------------


def test_dro_default_beta():
    lp, q, adv, _ = pg_case(40, 0.8, 1.2)
    assert_matches(run_loss("dro", lp, {"logprobs": q, "advantages": adv}), ref_dro(lp, q, adv, 0.05))


def test_dro_custom_beta():
    lp, q, adv, _ = pg_case(41, 0.8, 1.2)
    got = run_loss("dro", lp, {"logprobs": q, "advantages": adv}, {"beta": 0.7})
    assert_matches(got, ref_dro(lp, q, adv, 0.7))
    assert got[0].sum() != pytest.approx(ref_dro(lp, q, adv, 0.05)[0].sum(), abs=1e-6)


# ---- gspo ---------------------------------------------------------------------------------------


def gspo_case(seed: int, n: int, mask: np.ndarray, log_s: float):
    """Random (lp, q, A) whose masked mean of (lp - q) is exactly ``log_s``."""
    rng = np.random.default_rng(seed)
    q = rng.normal(-1.5, 0.7, size=n)
    delta = rng.normal(0.0, 0.4, size=n)
    m = mask != 0
    if m.any():
        delta[m] += log_s - delta[m].mean()
    lp = q + delta
    adv = np.where(np.arange(n) % 2 == 0, 1.0, -1.0) * rng.uniform(0.1, 2.0, size=n)
    return lp, q, adv


@pytest.mark.parametrize("log_s", [np.log(0.5), np.log(0.95), np.log(1.6)], ids=["s<lo", "lo<s<hi", "s>hi"])
def test_gspo_defaults_partial_mask(log_s):
    n = 12
    mask = np.array([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0], dtype=np.float64)  # prompt + padding unmasked
    lp, q, adv = gspo_case(50, n, mask, log_s)
    inputs = {"logprobs": q, "advantages": adv, "sequence_ratio_mask": mask}
    got = run_loss("gspo", lp, inputs)
    want = ref_gspo(lp, q, adv, mask, 0.8, 1.2)
    assert_matches(got, want)
    # the masked-out tokens do not move the sequence ratio but do get a gradient
    if 0.8 < np.exp(log_s) < 1.2:
        np.testing.assert_allclose(got[1], -adv * np.exp(log_s), atol=TOL)


def test_gspo_value_ignores_unmasked_logprobs():
    n = 10
    mask = np.array([0, 0, 0, 1, 1, 1, 1, 1, 0, 0], dtype=np.float64)
    lp, q, adv = gspo_case(51, n, mask, np.log(1.05))
    inputs = {"logprobs": q, "advantages": adv, "sequence_ratio_mask": mask}
    lp2 = lp.copy()
    lp2[mask == 0] += 3.0  # wildly different log-probs outside the mask
    a, b = run_loss("gspo", lp, inputs), run_loss("gspo", lp2, inputs)
    np.testing.assert_allclose(a[0], b[0], atol=TOL)
    np.testing.assert_allclose(a[1], b[1], atol=TOL)


def test_gspo_nonbinary_mask_is_a_set_not_a_weight():
    # M = {t : mask_t != 0}; the mean over M is unweighted.
    n = 8
    mask = np.array([0.0, 2.0, 0.5, 1.0, -1.0, 0.0, 3.0, 1.0])
    lp, q, adv = gspo_case(52, n, mask, np.log(1.1))
    inputs = {"logprobs": q, "advantages": adv, "sequence_ratio_mask": mask}
    assert_matches(run_loss("gspo", lp, inputs), ref_gspo(lp, q, adv, mask, 0.8, 1.2))


def test_gspo_custom_thresholds():
    n = 10
    mask = np.array([0, 1, 1, 1, 1, 1, 1, 1, 1, 0], dtype=np.float64)
    for seed, log_s in [(53, np.log(0.6)), (54, np.log(1.3)), (55, np.log(1.6))]:
        lp, q, adv = gspo_case(seed, n, mask, log_s)
        inputs = {"logprobs": q, "advantages": adv, "sequence_ratio_mask": mask}
        cfg = {"clip_low_threshold": 0.7, "clip_high_threshold": 1.4}
        assert_matches(run_loss("gspo", lp, inputs, cfg), ref_gspo(lp, q, adv, mask, 0.7, 1.4))


def test_gspo_per_token_thresholds():
    # s is one number per sequence; per-token thresholds put it below, inside and above.
    n = 12
    s = 1.1
    mask = np.array([0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0], dtype=np.float64)
    lp, q, adv = gspo_case(56, n, mask, np.log(s))
    adv = np.abs(adv) * np.tile([1.0, -1.0], n // 2)
    lo = np.array([1.2, 1.15, 0.8, 0.9, 0.5, 0.7, 1.3, 1.2, 0.6, 0.8, 0.9, 0.85])
    hi = np.array([1.5, 1.6, 1.05, 1.0, 1.2, 1.3, 1.5, 1.4, 1.0, 0.95, 1.4, 1.3])
    assert np.any(s < lo) and np.any(s > hi) and np.any((s > lo) & (s < hi))
    inputs = {
        "logprobs": q,
        "advantages": adv,
        "sequence_ratio_mask": mask,
        "clip_low_threshold": lo,
        "clip_high_threshold": hi,
    }
    got = run_loss("gspo", lp, inputs)
    assert_matches(got, ref_gspo(lp, q, adv, mask, lo, hi))
    assert np.any(got[1] == 0.0) and np.any(got[1] != 0.0)


def test_gspo_empty_mask():
    # log s = 0 (s = 1) when no token is in the mask
    n = 6
    mask = np.zeros(n)
    lp, q, adv = gspo_case(57, n, mask, 0.0)
    inputs = {"logprobs": q, "advantages": adv, "sequence_ratio_mask": mask}
    got = run_loss("gspo", lp, inputs)
    assert_matches(got, ref_gspo(lp, q, adv, mask, 0.8, 1.2))
    assert got[0].sum() == pytest.approx(-adv.sum(), abs=TOL)
    np.testing.assert_allclose(got[1], -adv, atol=TOL)
    assert np.all(np.isfinite(got[1]))


def test_gspo_empty_mask_with_clipping():
    n = 8
    mask = np.zeros(n)
    lp, q, adv = gspo_case(58, n, mask, 0.0)
    lo = np.array([1.1, 1.1, 0.5, 0.5, 0.8, 0.8, 1.05, 0.2])
    hi = np.array([1.5, 1.5, 0.9, 0.9, 1.2, 1.2, 1.3, 0.5])
    inputs = {
        "logprobs": q,
        "advantages": adv,
        "sequence_ratio_mask": mask,
        "clip_low_threshold": lo,
        "clip_high_threshold": hi,
    }
    assert_matches(run_loss("gspo", lp, inputs), ref_gspo(lp, q, adv, mask, lo, hi))


def test_gspo_full_mask_matches_sequence_level_ratio():
    # with every token masked in and one shared advantage, GSPO-token reduces to GSPO:
    # L = -N·min(s·A, clip(s)·A), gradient -A·s per token when unclipped.
    n = 7
    mask = np.ones(n)
    lp, q, _ = gspo_case(59, n, mask, np.log(0.9))
    adv = np.full(n, 0.75)
    value, grad = run_loss("gspo", lp, {"logprobs": q, "advantages": adv, "sequence_ratio_mask": mask})
    s = np.exp(np.mean(lp - q))
    assert value.sum() == pytest.approx(-n * s * 0.75, abs=TOL)
    np.testing.assert_allclose(grad, -0.75 * s, atol=TOL)


# ---- all losses: batch of random cases -----------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "dro"])
def test_random_cases_against_reference(name, seed):
    rng = np.random.default_rng(1000 + seed)
    lo, hi = float(rng.uniform(0.5, 0.9)), float(rng.uniform(1.1, 1.5))
    lp, q, adv, _ = pg_case(2000 + seed, lo, hi, n_per_cell=2)
    beta = float(rng.uniform(0.01, 1.0))
    cfg = {"clip_low_threshold": lo, "clip_high_threshold": hi} if name in ("ppo", "cispo") else {}
    if name == "dro":
        cfg = {"beta": beta}
    got = run_loss(name, lp, {"logprobs": q, "advantages": adv}, cfg)
    want = {
        "importance_sampling": lambda: ref_importance_sampling(lp, q, adv),
        "ppo": lambda: ref_ppo(lp, q, adv, lo, hi),
        "cispo": lambda: ref_cispo(lp, q, adv, lo, hi),
        "dro": lambda: ref_dro(lp, q, adv, beta),
    }[name]()
    assert_matches(got, want)


# ---- stable_reinforce ---------------------------------------------------------------------------


def stable_case(seed: int, c: float):
    """Ratios on both sides of the cap, both advantage signs, and prompt positions whose
    recorded log-prob is a placeholder 0 (the server fills nothing there)."""
    lp, q, adv, r = pg_case(seed, 0.5, c)
    sampled = np.ones_like(lp)
    sampled[:4] = 0.0
    q[:4] = 0.0
    lp[:4] = -rng_lp(seed, 4)
    assert np.any((r > c)[4:]) and np.any((r < c)[4:])
    return lp, q, adv, sampled


def rng_lp(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed + 7).exponential(3.0, size=n)


def test_stable_reinforce_defaults_truncate_at_two_without_kl():
    lp, q, adv, sampled = stable_case(60, 2.0)
    inputs = {"logprobs": q, "advantages": adv, "sampled_mask": sampled}
    got = run_loss("stable_reinforce", lp, inputs)
    assert_matches(got, ref_stable_reinforce(lp, q, adv, sampled, 2.0, 0.0))
    # prompt positions contribute nothing, and every sampled token keeps a gradient (unlike PPO)
    assert np.all(got[0][:4] == 0) and np.all(got[1][:4] == 0)
    assert np.all(got[1][4:] != 0)


@pytest.mark.parametrize(("c", "beta"), [(1.5, 0.1), (3.0, 1.0), (10.0, 0.02)])
def test_stable_reinforce_cap_and_kl(c, beta):
    lp, q, adv, sampled = stable_case(61, c)
    inputs = {"logprobs": q, "advantages": adv, "sampled_mask": sampled}
    cfg = {"clip_high_threshold": c, "kl_coeff": beta}
    assert_matches(run_loss("stable_reinforce", lp, inputs, cfg), ref_stable_reinforce(lp, q, adv, sampled, c, beta))


def test_stable_reinforce_on_policy_is_reinforce():
    # learner = sampler: ρ = 1, the KL term and its gradient vanish, the loss is -Σ A·lp.
    rng = np.random.default_rng(62)
    q = rng.normal(-1.0, 0.5, size=9)
    adv = rng.normal(size=9)
    inputs = {"logprobs": q, "advantages": adv, "sampled_mask": np.ones(9)}
    terms, grad = run_loss("stable_reinforce", q.copy(), inputs, {"kl_coeff": 0.5})
    np.testing.assert_allclose(terms, -adv * q, atol=TOL)
    np.testing.assert_allclose(grad, -adv, atol=TOL)


def test_stable_reinforce_kl_pulls_towards_the_sampler():
    # No advantage: only the KL term acts; its gradient has the sign of lp - q (descent moves
    # lp back towards q), and the term is ≥ 0.
    lp, q, _, sampled = stable_case(63, 2.0)
    inputs = {"logprobs": q, "advantages": np.zeros_like(lp), "sampled_mask": sampled}
    terms, grad = run_loss("stable_reinforce", lp, inputs, {"kl_coeff": 1.0})
    on = sampled != 0
    assert np.all(terms[on] >= 0)
    assert np.all(np.sign(grad[on]) == np.sign(lp[on] - q[on]))


def test_stable_reinforce_overflowing_ratio_without_kl_stays_finite():
    # A sampled token the sampler gave log-prob -120 and the learner ~0: ρ overflows float32.
    lp = torch.tensor([-0.01, -1.0], dtype=torch.float32, requires_grad=True)
    inputs = {
        "logprobs": torch.tensor([-120.0, -1.0]),
        "advantages": torch.tensor([1.0, 1.0]),
        "sampled_mask": torch.tensor([1.0, 1.0]),
    }
    terms = LOSSES["stable_reinforce"].fn(lp, inputs, dict(LOSSES["stable_reinforce"].config_defaults))
    terms.sum().backward()
    assert torch.isfinite(terms).all() and torch.isfinite(lp.grad).all()
    assert lp.grad[0].item() == pytest.approx(-2.0)  # the weight is capped at c = 2
