"""Custom losses that try to reach past their inputs (``evil_writer``, ``views_everywhere``,
``masked_copies``) and the data they run on: the SDK tests of custom losses and
``benchmarks/hostile.py``."""

from __future__ import annotations

import torch
from tinker import types

DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints(list(range(20 + i, 40 + i))),
        loss_fn_inputs={
            "target_tokens": list(range(21 + i, 41 + i)),
            "weights": [1.0] * 10 + [0.5] * 10,
            "advantages": [0.25 * (i + 1)] * 20,
        },
    )
    for i in range(3)
]


def evil_writer(logprobs):
    """The audit's attack: a last op that writes, through ``out=``, into a detached view of the
    packed log-probs (resized past its datum: the next datum, another tenant's, overwritten)."""
    big = torch.cat([torch.full_like(logprobs, 5.0)] * 3)
    return torch.mul(big, 1.0, out=logprobs.detach()).sum() * 0 + logprobs.sum(), {}


def views_everywhere(logprobs, weights):
    """What the allowed operations can do with views of the datum: detach, reshape, slices
    past the end, a zero-step broadcast; none of it may reach another datum."""
    flat = logprobs.detach().reshape(-1)[0:100000]
    tail = logprobs[-1:].unsqueeze(0).flatten()
    probe = torch.where(weights > 0, flat, torch.zeros_like(flat)) * 0
    return -(logprobs * weights).sum() + probe.sum() + tail.sum() * 0, {}


def masked_copies(logprobs):
    """The audit's memory hole: boolean-mask selections, whose size depends on the data, were
    not charged; ten of a long double value took the worker past its memory."""
    value = torch.cat([logprobs] * 64).double()
    mask = value > float("-inf")
    total = logprobs.sum()
    for _ in range(10):
        total = total + value[mask].sum() * 0
    return -total, {}
