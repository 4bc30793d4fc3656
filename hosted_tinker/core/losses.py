"""Tinker's built-in losses (protocol reference §7), one pure function each.

Every function takes one datum:

    lp      learner log-probs of ``target_tokens``: ``(N,)``, or ``(N, K)`` for top-K targets
    inputs  the datum's ``loss_fn_inputs`` as tensors aligned with ``lp`` (``target_tokens``
            excluded, it was consumed to compute ``lp``)
    config  the resolved ``loss_fn_config`` (defaults filled in)

and returns the datum's per-token loss terms, shaped like ``lp`` (returned to the client as
``elementwise_loss``). The datum's loss is their plain sum, and the caller sums over datums.
Nothing is normalised, which is exactly what the official service does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from hosted_tinker.core.types import DatumInput

LossFn = Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]


def cross_entropy(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """``L = -Σ w·lp``; weights may be any real numbers (custom losses send ``-dL/dlp``)."""
    return -(inputs["weights"] * lp)


def _ratio(lp: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    return torch.exp(lp - inputs["logprobs"])


def _clip_bounds(inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> tuple[Tensor | float, ...]:
    # Per-token thresholds (a tensor input) take precedence over the scalar config.
    lo = inputs.get("clip_low_threshold", config["clip_low_threshold"])
    hi = inputs.get("clip_high_threshold", config["clip_high_threshold"])
    return lo, hi


def _clamp(x: Tensor, lo: Tensor | float, hi: Tensor | float) -> Tensor:
    lo_t = torch.as_tensor(lo, dtype=x.dtype, device=x.device)
    hi_t = torch.as_tensor(hi, dtype=x.dtype, device=x.device)
    return torch.minimum(torch.maximum(x, lo_t), hi_t)


def importance_sampling(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """``L = -Σ r·A`` with ``r = exp(lp - q)``, unclipped."""
    return -(_ratio(lp, inputs) * inputs["advantages"])


def ppo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """``L = -Σ min(r·A, clip(r, lo, hi)·A)``."""
    ratio = _ratio(lp, inputs)
    adv = inputs["advantages"]
    clipped = _clamp(ratio, *_clip_bounds(inputs, config))
    return -torch.minimum(ratio * adv, clipped * adv)


def cispo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """``L = -Σ sg(clip(r, lo, hi))·lp·A``."""
    clipped = _clamp(_ratio(lp, inputs), *_clip_bounds(inputs, config)).detach()
    return -(clipped * lp * inputs["advantages"])


def dro(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """``L = -Σ (lp·A - ½β(lp - q)²)``."""
    q = inputs["logprobs"]
    return -(lp * inputs["advantages"] - 0.5 * config["beta"] * (lp - q) ** 2)


def gspo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """GSPO-token: the sequence ratio ``s`` as value, each token's own ``lp`` as gradient.

    ``log s = mean_{t: mask_t≠0}(sg(lp_t) - q_t)`` (0 when the mask is empty),
    ``ρ_t = exp(log s + lp_t - sg(lp_t))``, ``L = -Σ min(ρ·A, clip(ρ, lo, hi)·A)``.
    """
    mask = inputs["sequence_ratio_mask"] != 0
    lp_sg = lp.detach()
    n = mask.sum()
    log_s = torch.where(mask, lp_sg - inputs["logprobs"], torch.zeros_like(lp_sg)).sum() / n.clamp(min=1)
    rho = torch.exp(log_s + lp - lp_sg)
    adv = inputs["advantages"]
    clipped = _clamp(rho, *_clip_bounds(inputs, config))
    return -torch.minimum(rho * adv, clipped * adv)


def stable_reinforce(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """REINFORCE with a truncated importance weight and a KL trust region, on sampled tokens only.

    ``q`` is the sampler's log-prob of each token *as the server recorded it when sampling*
    (``record_stability_info``), ``m`` marks the targets that are sampled tokens (their
    provenance is a ``SampledProvenanceSpan``); prompt positions contribute nothing.

        ρ_t = exp(lp_t - q_t)
        L_t = m_t · ( -sg(min(ρ_t, c)) · A_t · lp_t  +  β · (ρ_t - 1 - log ρ_t) )

    The first term is the policy gradient of the sampled tokens corrected towards the learner
    by a truncated importance weight (Ionides 2008; "truncated importance sampling" for
    sampler/learner mismatch, Yao et al. 2025): unbiased while ρ ≤ c, bounded variance always,
    and, unlike PPO's clip, every token keeps a gradient. The second is the k3 estimator of
    KL(sampler ‖ learner) on the sampler's own tokens (Schulman 2020): ≥ 0, zero when the two
    agree, gradient β·(ρ - 1), pulling a learner that drifted from the sampler back.
    ``c`` = ``clip_high_threshold`` (2.0), ``β`` = ``kl_coeff`` (0.0).
    """
    sampled = inputs["sampled_mask"] != 0
    log_ratio = torch.where(sampled, lp - inputs["logprobs"], torch.zeros_like(lp))
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=config["clip_high_threshold"]).detach()
    terms = -weight * inputs["advantages"] * lp
    if config["kl_coeff"]:  # skipped at 0: a ratio that overflowed would make 0·inf a NaN
        terms = terms + config["kl_coeff"] * (ratio - 1 - log_ratio)
    return torch.where(sampled, terms, torch.zeros_like(terms))


@dataclass(frozen=True)
class LossSpec:
    """What a loss needs: its inputs (besides ``target_tokens``) and its config with defaults.

    ``recorded_inputs`` are filled by the server from what it recorded at sampling time, through
    the datum's provenance spans (``server.serving.provenance``); a client may send ``logprobs``
    among them only if they equal the record.
    """

    fn: LossFn
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_defaults: Mapping[str, float] = field(default_factory=dict)
    allows_topk_targets: bool = False
    recorded_inputs: tuple[str, ...] = ()
    # optional inputs a datum may leave out, and the value each of its positions then takes
    input_defaults: Mapping[str, float] = field(default_factory=dict)

    @property
    def needs_provenance(self) -> bool:
        return bool(self.recorded_inputs)


_PG_INPUTS = ("logprobs", "advantages")
_CLIP_TENSORS = ("clip_low_threshold", "clip_high_threshold")

LOSSES: dict[str, LossSpec] = {
    # the SDK's own examples of forward / forward_backward send target_tokens alone: every
    # position then counts once (the service's behaviour is not documented; this is the sum's)
    "cross_entropy": LossSpec(
        cross_entropy, (), ("weights",), allows_topk_targets=True, input_defaults={"weights": 1.0}
    ),
    "importance_sampling": LossSpec(importance_sampling, _PG_INPUTS),
    "ppo": LossSpec(ppo, _PG_INPUTS, _CLIP_TENSORS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    # CISPO is one-sided by default (tutorial 202): only large ratios are clipped.
    "cispo": LossSpec(cispo, _PG_INPUTS, _CLIP_TENSORS, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    # The official docs give 0.05 as the example β and no default; we make it the default.
    "dro": LossSpec(dro, _PG_INPUTS, (), {"beta": 0.05}),
    # The official docs name ε_low/ε_high without defaults; we use PPO's.
    "gspo": LossSpec(
        gspo,
        (*_PG_INPUTS, "sequence_ratio_mask"),
        _CLIP_TENSORS,
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    ),
    # Ours (the official objective is not published): see ``stable_reinforce``. The client's
    # ``logprobs``, if sent, must equal the record; the loss reads the record.
    "stable_reinforce": LossSpec(
        stable_reinforce,
        ("advantages",),
        ("logprobs",),
        {"clip_high_threshold": 2.0, "kl_coeff": 0.0},
        recorded_inputs=("logprobs", "sampled_mask"),
    ),
}


def sampler_gap(data: Sequence[DatumInput], logprobs: Sequence[np.ndarray]) -> dict[str, float]:
    """How far the learner's log-probs are from the sampler's, ``|lp - q|`` over the tokens that
    carry loss (sampled tokens where provenance marks them, else nonzero advantages): the first
    thing to look at when sampler and trainer numerics drift. Empty for losses without ``q``."""
    gaps = []
    for d, lp in zip(data, logprobs, strict=True):
        q = d.inputs.get("logprobs")
        if q is None or lp.ndim != 1:
            continue
        mask = d.inputs.get("sampled_mask", d.inputs.get("advantages"))
        on = (mask != 0).numpy() if mask is not None else np.ones(len(lp), dtype=bool)
        gaps.append(np.abs(lp[on].astype(np.float64) - q.numpy()[on]))
    gap = np.concatenate(gaps) if gaps else np.zeros(0)
    if not gap.size:
        return {}
    return {"sampler_logprob_gap:mean": float(gap.mean()), "sampler_logprob_gap:max": float(gap.max())}
