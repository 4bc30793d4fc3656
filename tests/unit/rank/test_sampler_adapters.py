"""The embedded sampler builds an adapter from a PEFT config and tensors as PEFT would: the same
layers for each form ``target_modules`` takes (full names, the last-part names PEFT itself
writes, a regular expression, ``all-linear``), the same scale (``use_rslora`` too), so its
logits are PEFT's; and an adapter that does not fit the model is refused, leaving nothing."""

from __future__ import annotations

import pytest
import torch

from hosted_tinker.core.errors import UserError
from hosted_tinker.core.types import LoraSpec
from hosted_tinker.rank.model import load_base
from hosted_tinker.rank.serve import Rank, local_rank

pytestmark = [pytest.mark.fast, pytest.mark.timeout(120)]

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def rank(tiny_model_dir) -> Rank:
    return local_rank(str(tiny_model_dir))


def adapter_tensors(rank: Rank, spec: LoraSpec) -> dict[str, torch.Tensor]:
    """A trained-looking adapter's tensors (B moved off zero) under PEFT's keys."""
    handle = rank.trainer.model.add_adapter(spec)
    try:
        g = torch.Generator().manual_seed(spec.seed)
        moved = (p.detach() + 0.05 * torch.randn(p.shape, generator=g) for p in handle.params)
        return dict(zip(handle.keys, moved, strict=True))
    finally:
        rank.trainer.model.remove_adapter(handle)


def sampler_logits(rank: Rank, key: str, tokens: torch.Tensor) -> torch.Tensor:
    adapters = rank.sampler.adapters
    adapters.routes.everything(rank.sampler.loaded[key])
    try:
        with torch.no_grad():
            return adapters.lm(input_ids=tokens[None]).logits[0]
    finally:
        adapters.routes.everything(None)


def peft_logits(rank: Rank, config: dict, weights: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    base = rank.trainer.model.base
    model = get_peft_model(load_base(base.config.name_or_path, torch.device("cpu"), "float32"), LoraConfig(**config))
    set_peft_model_state_dict(model, weights)
    with torch.no_grad():
        return model(input_ids=tokens[None]).logits[0]


FORMS = {
    "full names": lambda modules: modules,
    "last parts (PEFT's own)": lambda modules: sorted({m.rsplit(".", 1)[-1] for m in modules}),
    "regular expression": lambda modules: r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
    "all-linear": lambda modules: "all-linear",
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rslora", [False, True])
def test_logits_are_peft_own_for_every_form_of_target_modules(rank: Rank, form: str, rslora: bool):
    weights = adapter_tensors(rank, LoraSpec(rank=4, seed=3, train_unembed=False))  # attention and MLP
    modules = sorted({k.removeprefix("base_model.model.").rsplit(".", 2)[0] for k in weights})
    config = {"r": 4, "lora_alpha": 16, "target_modules": FORMS[form](modules), "use_rslora": rslora}
    key = f"{form} {rslora}"
    rank.sampler.load_sampler(key, {"peft_type": "LORA", "bias": "none", **config}, weights)
    tokens = torch.arange(5, 37)
    ours = sampler_logits(rank, key, tokens)
    torch.testing.assert_close(ours, peft_logits(rank, config, weights, tokens), rtol=0, atol=1e-5)
    with torch.no_grad():
        plain = rank.sampler.adapters.lm(input_ids=tokens[None]).logits[0]
    assert not torch.allclose(ours, plain)  # the adapter did change them


def test_an_adapter_on_the_output_layer(rank: Rank):
    weights = adapter_tensors(rank, LoraSpec(rank=2, seed=4, train_attn=False, train_mlp=False, train_unembed=True))
    config = {"r": 2, "lora_alpha": 32, "target_modules": ["lm_head"]}
    rank.sampler.load_sampler("head", config, weights)
    tokens = torch.arange(3, 20)
    torch.testing.assert_close(
        sampler_logits(rank, "head", tokens), peft_logits(rank, config, weights, tokens), rtol=0, atol=1e-5
    )


def _misfits(weights: dict[str, torch.Tensor]) -> dict[str, tuple[dict, dict[str, torch.Tensor]]]:
    good = {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": ATTN}
    a_key = next(k for k in weights if k.endswith("lora_A.weight"))
    return {
        "a tensor of another shape": (good, {**weights, a_key: torch.zeros(4, 3)}),
        "a matrix missing": (good, {k: v for k, v in weights.items() if k != a_key}),
        "a tensor no layer takes": (good, {**weights, "base_model.model.nowhere.lora_A.weight": torch.zeros(4, 4)}),
        "targets beyond the tensors": (good | {"target_modules": [*ATTN, "gate_proj"]}, weights),
        "another rank": (good | {"r": 8}, weights),
        "a bias": (good | {"bias": "all"}, weights),
        "not LoRA": (good | {"peft_type": "IA3"}, weights),
        "no rank": ({k: v for k, v in good.items() if k != "r"}, weights),
    }


MISFITS = [
    "a tensor of another shape",
    "a matrix missing",
    "a tensor no layer takes",
    "targets beyond the tensors",
    "another rank",
    "a bias",
    "not LoRA",
    "no rank",
]


@pytest.mark.parametrize("case", MISFITS)
def test_an_adapter_that_does_not_fit_is_refused_and_leaves_nothing(rank: Rank, case: str):
    weights = adapter_tensors(rank, LoraSpec(rank=4, seed=5, train_mlp=False, train_unembed=False))
    config, tensors = _misfits(weights)[case]
    resident = dict(rank.sampler.adapters.adapters)
    with pytest.raises(UserError, match="does not fit the served model"):
        rank.sampler.load_sampler(f"misfit {case}", config, tensors)
    assert not rank.sampler.has_sampler(f"misfit {case}")
    assert rank.sampler.adapters.adapters == resident


@pytest.mark.parametrize(
    "setting", [{"alpha_pattern": {"q_proj": 64}}, {"layers_to_transform": [0]}, {"use_dora": True}]
)
def test_peft_settings_this_server_does_not_apply_are_refused_by_name(rank: Rank, setting: dict):
    weights = adapter_tensors(rank, LoraSpec(rank=4, seed=6, train_mlp=False, train_unembed=False))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": ATTN, **setting}
    with pytest.raises(UserError, match=f"sets {next(iter(setting))}"):
        rank.sampler.load_sampler(f"setting {setting}", config, weights)
