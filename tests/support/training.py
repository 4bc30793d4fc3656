"""Training a model through the SDK for a few steps and comparing two models' states bit for bit."""

from __future__ import annotations

import numpy as np
from tinker import types


def train(tc, steps: int) -> list[tuple[float, list[np.ndarray]]]:
    """Run SFT steps; return each step's loss:sum and per-datum logprobs."""
    out = []
    for _ in range(steps):
        fb = tc.forward_backward(DATA, "cross_entropy")
        tc.optim_step(ADAM).result()
        result = fb.result()
        out.append((result.metrics["loss:sum"], [o["logprobs"].to_numpy() for o in result.loss_fn_outputs]))
    return out


def assert_identical(a, b) -> None:
    for (loss_a, lps_a), (loss_b, lps_b) in zip(a, b, strict=True):
        assert loss_a == loss_b
        for x, y in zip(lps_a, lps_b, strict=True):
            np.testing.assert_array_equal(x, y)


def datums(seed: int, count: int, length: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        tokens = rng.integers(10, 500, length + 1).tolist()
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length},
            )
        )
    return out


DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints(list(range(10 + i, 40 + i))),
        loss_fn_inputs={"target_tokens": list(range(11 + i, 41 + i)), "weights": [1.0] * 30},
    )
    for i in range(3)
]

ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=5.0)
