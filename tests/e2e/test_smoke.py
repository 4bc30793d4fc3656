"""The fast loop's one end-to-end check (``pytest -m fast``): the real server, started by
``conftest.start_server`` on the tiny model, driven by the real ``tinker`` SDK. A LoRA training
client takes one forward_backward and one optim_step, the loss falls, and the trained adapter
samples. A few seconds once the server is up; the full suites are the ``slow`` tests."""

from __future__ import annotations

import math

import pytest
from tinker import types

from tests.support.server import ALIAS

pytestmark = [pytest.mark.fast, pytest.mark.timeout(120)]


def test_train_one_step_and_sample(service_client):
    tc = service_client.create_lora_training_client(base_model=ALIAS, rank=4, seed=0).result()
    tokens = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    before = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert step.metrics["optimizer_step"] == 1.0
    after = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert math.isfinite(before) and before > 0
    assert math.isfinite(after) and after < before, (before, after)

    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokens[:3])
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    assert len(out.sequences) == 1 and len(out.sequences[0].tokens) == 4
    assert all(math.isfinite(lp) for lp in out.sequences[0].logprobs)
