"""``--lora-compute``: LoRA's products and the update's sum in float32 (PEFT's arithmetic over
float32 adapters, the default) or in the base's dtype (``base``: PEFT under ``torch.autocast``).
Either way the adapters, their gradients and the optimizer's state are float32. Checked bit for
bit against PEFT's own layer, with and without autocast; then on a trainer and its sampler; then
through the SDK on a server started with it (megatron's: ``test_megatron.py``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS, start_server
from tests.support.training import assert_identical, train


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_sdk_trains_resumes_and_samples_under_base_compute(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``--dtype bfloat16 --lora-compute base``: /healthz says so, training resumes bit for bit
    from a saved state, and the trained weights sample."""
    server = start_server(tmp_path / "server", "--dtype", "bfloat16", "--lora-compute", "base")
    try:
        caps = httpx.get(f"{server.base_url}/healthz", timeout=5).json()["capabilities"]
        assert (caps["dtype"], caps["lora_compute"]) == ("bfloat16", "base")
        with tinker.ServiceClient(base_url=server.base_url) as sc:
            tc = sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=0).result()
            first = train(tc, 2)
            assert all(np.isfinite(loss) for loss, _ in first)
            path = tc.save_state("base-compute").result().path
            uninterrupted = train(tc, 2)
            resumed = sc.create_training_client_from_state_with_optimizer(path).result()
            assert_identical(train(resumed, 2), uninterrupted)
            sampler = tc.save_weights_and_get_sampling_client("base-compute")
            params = types.SamplingParams(max_tokens=5, temperature=0.0)
            sequence = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, params).result().sequences[0]
            assert len(sequence.tokens) == 5
    finally:
        server.stop()
