"""Tinker's built-in losses (protocol reference §7), one pure function each.

Every function takes one datum:

    lp      learner log-probs of ``target_tokens``: ``(N,)``, or ``(N, K)`` for top-K targets
    inputs  the datum's ``loss_fn_inputs`` as tensors aligned with ``lp`` (``target_tokens``
            excluded, it was consumed to compute ``lp``)
    config  the resolved ``loss_fn_config`` (defaults filled in)

and returns the datum's scalar loss. Losses are plain sums over tokens; the caller sums over
datums. Nothing is normalised, which is exactly what the official service does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

LossFn = Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]


def cross_entropy(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """``L = -Σ w·lp``; weights may be any real numbers (custom losses send ``-dL/dlp``)."""
    return -(inputs["weights"] * lp).sum()


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
    return -(_ratio(lp, inputs) * inputs["advantages"]).sum()


def ppo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """``L = -Σ min(r·A, clip(r, lo, hi)·A)``."""
    ratio = _ratio(lp, inputs)
    adv = inputs["advantages"]
    clipped = _clamp(ratio, *_clip_bounds(inputs, config))
    return -torch.minimum(ratio * adv, clipped * adv).sum()


def cispo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """``L = -Σ sg(clip(r, lo, hi))·lp·A``."""
    clipped = _clamp(_ratio(lp, inputs), *_clip_bounds(inputs, config)).detach()
    return -(clipped * lp * inputs["advantages"]).sum()


def dro(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """``L = -Σ (lp·A - ½β(lp - q)²)``."""
    q = inputs["logprobs"]
    return -(lp * inputs["advantages"] - 0.5 * config["beta"] * (lp - q) ** 2).sum()


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
    return -torch.minimum(rho * adv, clipped * adv).sum()


@dataclass(frozen=True)
class LossSpec:
    """What a loss needs: its inputs (besides ``target_tokens``) and its config with defaults."""

    fn: LossFn
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_defaults: Mapping[str, float] = field(default_factory=dict)
    allows_topk_targets: bool = False


_PG_INPUTS = ("logprobs", "advantages")
_CLIP_TENSORS = ("clip_low_threshold", "clip_high_threshold")

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("weights",), allows_topk_targets=True),
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
}

# Names the SDK can send that this server does not implement: a clear 400, never a wrong answer.
UNSUPPORTED_LOSSES: dict[str, str] = {
    "stable_reinforce": "needs server-recorded sampling stability info, which this server does not keep",
    "custom": "server-side custom losses are not enabled; the SDK's client-side forward_backward_custom works",
}
