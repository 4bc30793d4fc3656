"""The benchmark-only ``synthetic`` model (``benchmarks/gateway_scale.py``): its adapters are
plain tensors, but under PEFT's names and shapes, so that what the gateway moves (checkpoints,
exports) is what a real model's would be."""

from __future__ import annotations

from pathlib import Path

import pytest

from hosted_tinker.core.types import LoraSpec
from hosted_tinker.rank.model import HfLoraModel, SyntheticLoraModel

pytestmark = [pytest.mark.fast, pytest.mark.timeout(120)]


@pytest.mark.parametrize("spec", [LoraSpec(rank=4, seed=1), LoraSpec(rank=8, seed=2, train_mlp=False)])
def test_synthetic_adapters_have_the_real_ones_names_and_shapes(tiny_model_dir: Path, spec: LoraSpec):
    real = HfLoraModel(str(tiny_model_dir)).add_adapter(spec)
    model = SyntheticLoraModel(str(tiny_model_dir))
    synthetic = model.add_adapter(spec)
    assert sorted(synthetic.keys) == sorted(real.keys)
    shapes = dict(zip(real.keys, (p.shape for p in real.params), strict=True))
    assert all(shapes[k] == p.shape for k, p in zip(synthetic.keys, synthetic.params, strict=True))
    config = model.adapter_config(synthetic)
    assert config["r"] == spec.rank
    assert sorted(config["target_modules"]) == sorted({k.split(".", 2)[2].rsplit(".", 2)[0] for k in real.keys})
    assert model.add_adapter(spec).name != synthetic.name
