"""A training step and a datum, for the residency, Docker and VM tests."""

from __future__ import annotations

import tinker
from tinker import types


def datum(k: int) -> types.Datum:
    tokens = [(7 * k + i) % 50 + 5 for i in range(6)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 5},
    )


def step(tc: tinker.TrainingClient, k: int) -> float:
    loss = tc.forward_backward([datum(k)], "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return loss
