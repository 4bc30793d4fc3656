"""LoRA on the routed experts of mixture-of-experts models (``rank.experts``), pinned against an
independent float64 reference (``tests.support.lora_reference``): the same HF model in float64
with every adapter applied by hand. Tiny random Qwen3-MoE (fused concatenated experts),
DeepSeek-V3 (MLA, a dense layer 0, shared experts) and Qwen3.5-MoE (hybrid linear attention,
a shared expert with its gate) models are built in the test; nothing is downloaded."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import Tensor

from hosted_tinker.core.tiny_model import build_tiny_model
from hosted_tinker.core.types import DatumInput, LoraSpec
from hosted_tinker.rank.adapters import KEY_PREFIX
from hosted_tinker.rank.model import HfLoraModel
from hosted_tinker.rank.serve import Rank, local_rank
from tests.support.lora_reference import (
    assert_as_close_as_float32_goes,
    assert_close_in_float32,
    datum,
    reference_logprobs,
    trained_looking,
)

pytestmark = [pytest.mark.fast, pytest.mark.timeout(300)]

MOE_FAMILIES = ("qwen3_moe", "deepseek_v3", "qwen3_5_moe", "qwen3_vl_moe")  # hybrid linear attention; deepstack VL


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def rank(request, tmp_path_factory) -> Rank:
    path = build_tiny_model(tmp_path_factory.mktemp("models") / request.param, family=request.param, hidden_size=64)
    return local_rank(str(path))


# ---- the tests -----------------------------------------------------------------------------------


def test_train_mlp_puts_lora_on_every_expert_in_tinkers_layout(rank: Rank):
    model: HfLoraModel = rank.trainer.model
    handle = model.add_adapter(LoraSpec(rank=4, seed=1, train_attn=False, train_unembed=False))
    try:
        shapes = dict(zip(handle.keys, (tuple(p.shape) for p in handle.params), strict=True))
        experts = [k for k in shapes if ".experts." in k]
        layers_with_experts = {k.split(".experts.")[0] for k in experts}
        assert layers_with_experts and len(experts) == 6 * len(layers_with_experts)
        text = model.base.config
        e, h, i = 8, 64, text.moe_intermediate_size  # Qwen3-VL's tiny experts are narrower (``tiny_model``)
        for prefix in layers_with_experts:  # the hidden side's factor one for all experts (Tinker's)
            assert shapes[f"{prefix}.experts.w1.lora_A.weight"] == (1, 4, h)
            assert shapes[f"{prefix}.experts.w1.lora_B.weight"] == (e, i, 4)
            assert shapes[f"{prefix}.experts.w3.lora_A.weight"] == (1, 4, h)
            assert shapes[f"{prefix}.experts.w3.lora_B.weight"] == (e, i, 4)
            assert shapes[f"{prefix}.experts.w2.lora_A.weight"] == (e, 4, i)
            assert shapes[f"{prefix}.experts.w2.lora_B.weight"] == (1, h, 4)
        assert not any("router" in k or k.endswith("mlp.gate.lora_A.weight") for k in shapes)  # routers frozen
        assert model.adapter_config(handle)["r"] == 4
    finally:
        model.remove_adapter(handle)


def test_logprobs_and_every_experts_gradients_equal_the_float64_reference(rank: Rank):
    model: HfLoraModel = rank.trainer.model
    handle = trained_looking(model, LoraSpec(rank=4, seed=2, train_unembed=False))  # attention, MLPs, experts
    try:
        data = datum(list(range(7, 40)))
        ours = model.logprobs([handle], [data])[0]
        grads = torch.autograd.grad(ours.sum(), handle.params)
        weights = dict(zip(handle.keys, handle.params, strict=True))
        scale = model.adapters.adapters[handle.name].scale
        expected, expected_grads = reference_logprobs(model, weights, scale, data)
        _, in_float32 = reference_logprobs(model, weights, scale, data, torch.float32)
        torch.testing.assert_close(ours.double(), expected, rtol=0, atol=2e-5)
        for key, grad in zip(handle.keys, grads, strict=True):
            # a gradient through the routing weights' softmax keeps fewer digits in float32 (the
            # float32 reference's own distance, on some CPUs above assert_close_in_float32's bound)
            assert_as_close_as_float32_goes(grad, expected_grads[key], in_float32[key])
        assert any(".experts." in k and g.abs().sum() > 0 for k, g in zip(handle.keys, grads, strict=True))
    finally:
        model.remove_adapter(handle)


def test_only_the_experts_a_batch_routed_to_get_gradients(rank: Rank):
    model: HfLoraModel = rank.trainer.model
    handle = trained_looking(model, LoraSpec(rank=4, seed=3, train_attn=False, train_unembed=False))
    routed: dict[str, set[int]] = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda m, args, name=name: routed.setdefault(name, set()).update(args[1].flatten().tolist())
        )
        for name, module in model.base.named_modules()
        if name in model.adapters.experts
    ]
    try:
        ours = model.logprobs([handle], [datum([5, 9, 11])])[0]  # 2 tokens, 2 experts each: at most 4 of 8
        grads = dict(zip(handle.keys, torch.autograd.grad(ours.sum(), handle.params), strict=True))
    finally:
        for h in hooks:
            h.remove()
        model.remove_adapter(handle)
    for experts, hit in routed.items():
        assert len(hit) < 8
        for projection, part in (("w1", "B"), ("w3", "B"), ("w2", "A")):  # the experts' own factors
            grad = grads[f"{KEY_PREFIX}{experts}.{projection}.lora_{part}.weight"]
            with_gradient = {e for e in range(grad.shape[0]) if grad[e].abs().sum() > 0}
            assert with_gradient == hit, (experts, projection)


def test_a_joint_pass_gives_each_model_its_own_experts(rank: Rank):
    """Two models' data in one pass over the base: each token through its own adapter's experts,
    so each model's log-probs and gradients are what it gets alone."""
    model: HfLoraModel = rank.trainer.model
    a = trained_looking(model, LoraSpec(rank=4, seed=4, train_unembed=False))
    b = trained_looking(model, LoraSpec(rank=4, seed=5, train_unembed=False))
    try:
        da, db = datum(list(range(3, 30))), datum(list(range(40, 52)))
        joint = model.logprobs([a, b], [da, db])
        joint_grads = torch.autograd.grad(joint[0].sum() + joint[1].sum(), a.params + b.params)
        alone_a = model.logprobs([a], [da])[0]
        grads_a = torch.autograd.grad(alone_a.sum(), a.params)
        alone_b = model.logprobs([b], [db])[0]
        grads_b = torch.autograd.grad(alone_b.sum(), b.params)
        torch.testing.assert_close(joint[0], alone_a, rtol=0, atol=1e-5)
        torch.testing.assert_close(joint[1], alone_b, rtol=0, atol=1e-5)
        for got, want in zip(joint_grads, grads_a + grads_b, strict=True):
            assert_close_in_float32(got, want)
    finally:
        model.remove_adapter(a)
        model.remove_adapter(b)


def test_experts_without_an_adapter_are_transformers_own(rank: Rank):
    """Tokens under an adapter without expert LoRA (attention only) or none: the experts compute
    exactly what transformers' eager implementation computes."""
    model: HfLoraModel = rank.trainer.model
    handle = trained_looking(model, LoraSpec(rank=4, seed=6, train_mlp=False, train_unembed=False))
    try:
        name = next(iter(model.adapters.experts))
        experts = model.base.get_submodule(name)
        hidden = torch.randn(10, 64)
        index = torch.stack([torch.randperm(experts.num_experts)[:2] for _ in range(10)])
        weight = torch.rand(10, 2).softmax(-1)
        model.adapters.routes.everything(handle.name)
        ours = experts(hidden, index, weight)
        eager = type(experts).forward.__wrapped__(experts, hidden, index, weight)  # the class's own forward
        torch.testing.assert_close(ours, eager, rtol=0, atol=1e-6)
    finally:
        model.adapters.routes.everything(None)
        model.remove_adapter(handle)


def test_the_sampler_samples_the_expert_adapter_as_trained(rank: Rank):
    """The embedded sampler, fed the adapter's config and tensors as a checkpoint holds them
    (written and read back through the checkpoint files), scores tokens exactly as the trainer does."""
    model: HfLoraModel = rank.trainer.model
    handle = trained_looking(model, LoraSpec(rank=4, seed=7))
    try:
        data = datum(list(range(12, 44)))
        with torch.no_grad():
            trained = model.logprobs([handle], [data])[0]
        from hosted_tinker.core.checkpoints import adapter_files, adapter_weights

        tensors = {k: p.detach() for k, p in zip(handle.keys, handle.params, strict=True)}
        files = adapter_files(model.adapter_config(handle), tensors)
        rank.sampler.load_sampler(
            "moe-sampler", model.adapter_config(handle), adapter_weights(files["adapter_model.safetensors"])
        )
        sampler = rank.sampler.adapters
        sampler.routes.everything(rank.sampler.loaded["moe-sampler"])
        with torch.no_grad():
            logits = sampler.lm(input_ids=data.tokens[None]).logits[0]
        sampled = logits.log_softmax(-1).gather(-1, data.target_tokens[:, None])[:, 0]
        torch.testing.assert_close(sampled, trained, rtol=0, atol=1e-5)
    finally:
        rank.sampler.adapters.routes.everything(None)
        model.remove_adapter(handle)


def test_recomputed_layers_give_the_same_gradients(rank: Rank):
    """Layers that keep only their input and run again in the backward pass route each token to
    the same experts under the same adapter: the same log-probs and gradients."""
    model: HfLoraModel = rank.trainer.model
    handle = trained_looking(model, LoraSpec(rank=4, seed=8, train_unembed=False))
    try:
        data = datum(list(range(20, 50)))
        kept = model.logprobs([handle], [data])[0]
        kept_grads = torch.autograd.grad(kept.sum(), handle.params)
        again = model.logprobs([handle], [data], recompute=len(model.layers))[0]
        again_grads = torch.autograd.grad(again.sum(), handle.params)
        torch.testing.assert_close(again, kept, rtol=0, atol=0)
        for got, want in zip(again_grads, kept_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        model.remove_adapter(handle)


@pytest.mark.parametrize("flags", [(True, True, True), (True, False, False), (False, True, True)])
def test_an_adapters_bytes_are_counted_from_the_parameters_it_makes(rank: Rank, flags):
    """What a key's ``adapter_bytes`` limit counts (``core.types.adapter_bytes``, from
    ``Capabilities.lora_params_per_rank``): the parameters an adapter of that shape has, each with
    its gradient and AdamW's two moments, all float32."""
    from hosted_tinker.core.types import adapter_bytes

    model: HfLoraModel = rank.trainer.model
    spec = LoraSpec(rank=3, seed=1, train_attn=flags[0], train_mlp=flags[1], train_unembed=flags[2])
    handle = model.add_adapter(spec)
    try:
        params = sum(p.numel() for p in handle.params)
        assert rank.capabilities.lora_params_per_rank == model.lora_params_per_rank
        assert adapter_bytes(spec, rank.capabilities.lora_params_per_rank) == params * 16
    finally:
        model.remove_adapter(handle)


# ---- Tinker's own counts ---------------------------------------------------------------------------

QWEN3 = {"num_attention_heads": 32, "head_dim": 128, "vocab_size": 151936}
# Hugging Face configs of models the service trains, as far as LoRA's shapes depend on them
REAL_CONFIGS = {
    "Qwen/Qwen3-8B": (
        "Qwen3Config",
        QWEN3 | {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_key_value_heads": 8},
    ),
    "Qwen/Qwen3-32B": (
        "Qwen3Config",
        QWEN3
        | {
            "hidden_size": 5120,
            "intermediate_size": 25600,
            "num_hidden_layers": 64,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
        },
    ),
    "Qwen/Qwen3-4B-Instruct-2507": (
        "Qwen3Config",
        QWEN3
        | {
            "hidden_size": 2560,
            "intermediate_size": 9728,
            "num_hidden_layers": 36,
            "num_key_value_heads": 8,
            "tie_word_embeddings": True,
        },
    ),
    "Qwen/Qwen3-30B-A3B": (
        "Qwen3MoeConfig",
        QWEN3
        | {
            "hidden_size": 2048,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_key_value_heads": 4,
            "num_experts": 128,
            "num_experts_per_tok": 8,
        },
    ),
    "Qwen/Qwen3-235B-A22B-Instruct-2507": (
        "Qwen3MoeConfig",
        QWEN3
        | {
            "hidden_size": 4096,
            "moe_intermediate_size": 1536,
            "num_hidden_layers": 94,
            "num_attention_heads": 64,
            "num_key_value_heads": 4,
            "num_experts": 128,
            "num_experts_per_tok": 8,
        },
    ),
    "openai/gpt-oss-20b": (
        "GptOssConfig",
        {"hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24, "num_local_experts": 32},
    ),
    "openai/gpt-oss-120b": (
        "GptOssConfig",
        {"hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36, "num_local_experts": 128},
    ),
    # hybrid: three Gated-DeltaNet layers (LoRA on q, k, v apart, z and out) to one gated full
    # attention layer (``rank.linear_attention``); transformers' defaults are Qwen3.5-9B's shape
    "Qwen/Qwen3.5-4B": (
        "Qwen3_5TextConfig",
        {"hidden_size": 2560, "intermediate_size": 9216, "tie_word_embeddings": True},
    ),
    "Qwen/Qwen3.5-9B": ("Qwen3_5TextConfig", {}),
    "Qwen/Qwen3.5-27B": (
        "Qwen3_5TextConfig",
        {
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 64,
            "num_attention_heads": 24,
            "linear_num_value_heads": 48,
        },
    ),
    "Qwen/Qwen3.5-35B-A3B": (
        "Qwen3_5MoeTextConfig",
        {
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "num_experts": 256,
            "num_experts_per_tok": 8,
        },
    ),
    # vision-language: the language model trains (``rank.vision``), its deepstack tower takes no LoRA
    "Qwen/Qwen3-VL-30B-A3B-Instruct": (
        "Qwen3VLMoeConfig",
        {
            "text_config": QWEN3
            | {"hidden_size": 2048, "moe_intermediate_size": 768, "num_hidden_layers": 48}
            | {"num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8}
        },
    ),
    "Qwen/Qwen3-VL-235B-A22B-Instruct": (
        "Qwen3VLMoeConfig",
        {
            "text_config": QWEN3
            | {"hidden_size": 4096, "moe_intermediate_size": 1536, "num_hidden_layers": 94}
            | {"num_attention_heads": 64, "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8}
        },
    ),
}


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_lora_parameters_per_rank_are_the_services(name: str):
    """The cookbook lists, for the service's models, how many LoRA parameters one rank adds under
    each of train_attn, train_mlp and train_unembed (measured on the service). The modules and
    shapes this server puts LoRA on give the same counts: for MoE models that is one LoRA per
    routed expert with the hidden side's factor shared (``rank.experts``), shared experts as
    linear layers, and no LoRA on routers or a shared expert's gate; for Qwen3.5's linear
    attention, q, k and v each their own LoRA and none on the per-head gates."""
    import transformers
    from tinker_cookbook.hyperparam_utils import _LORA_PARAMS_PER_RANK_BY_COMPONENT as SERVICE

    from hosted_tinker.rank.adapters import LoraAdapters
    from hosted_tinker.rank.model import target_modules
    from hosted_tinker.rank.vision import causal_lm

    config_class, fields = REAL_CONFIGS[name]
    config = getattr(transformers, config_class)(**fields)
    with torch.device("meta"):  # shapes only: no memory, no weights
        if hasattr(config, "vision_config"):  # the language model over the whole model's parts, as served
            model = causal_lm(transformers.AutoModelForImageTextToText.from_config(config))
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
    adapters = LoraAdapters(model)
    counts = {
        group: sum(math.prod(shape) for target in targets for shape in adapters.lora_shapes(target, 1))
        for group, targets in target_modules(model).items()
    }
    assert counts == SERVICE[name]


def test_interleaved_transposed_experts_with_biases_take_lora_as_the_reference():
    """gpt-oss keeps its experts transposed, gate and up rows interleaved, with biases and a
    clamped gate of its own (issue #40 makes the model start): the same seam gives each routed
    token its expert's LoRA there too, against a float64 reference one token at a time."""
    import transformers

    from hosted_tinker.rank.experts import HOOK_ATTR, ExpertsHook, ExpertSpan, fused_experts, lora_experts_forward

    config = transformers.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    shape = fused_experts(experts)
    assert (shape.experts, shape.hidden, shape.intermediate) == (8, 64, 32)
    loras = {}
    for projection in ("w1", "w3", "w2"):
        a_shape, b_shape = shape.lora_shapes(projection, 4)
        loras[projection] = (0.3 * torch.randn(a_shape), 0.3 * torch.randn(b_shape))
    hidden = torch.randn(12, 64)
    index = torch.stack([torch.randperm(8)[:2] for _ in range(12)])
    weight = torch.rand(12, 2).softmax(-1)
    without = lora_experts_forward(experts, hidden, index, weight)
    torch.testing.assert_close(
        without, type(experts).forward.__wrapped__(experts, hidden, index, weight), atol=1e-5, rtol=0
    )

    setattr(experts, HOOK_ATTR, ExpertsHook(lambda tokens: [ExpertSpan(0, tokens, loras, 0.5)], "float32"))
    ours = lora_experts_forward(experts, hidden, index, weight)

    ref = copy.deepcopy(experts).double()
    d = {p: (a.double(), b.double()) for p, (a, b) in loras.items()}

    def update(projection: str, e: int, v: Tensor) -> Tensor:
        a, b = d[projection]
        return 0.5 * (b[e if len(b) > 1 else 0] @ (a[e if len(a) > 1 else 0] @ v))

    expected = torch.zeros(12, 64, dtype=torch.float64)
    for t in range(12):
        x = hidden[t].double()
        for k in range(2):
            e = int(index[t, k])
            gate_up = x @ ref.gate_up_proj[e] + ref.gate_up_proj_bias[e]
            lora = torch.stack([update("w1", e, x), update("w3", e, x)], -1).flatten()  # g0, u0, g1, u1, ...
            h = ref._apply_gate(gate_up + lora)
            out = h @ ref.down_proj[e] + ref.down_proj_bias[e] + update("w2", e, h)
            expected[t] += weight[t, k].double() * out
    torch.testing.assert_close(ours.double(), expected, atol=2e-5, rtol=0)
    assert not torch.allclose(ours, without)


def test_the_gpus_padded_grouped_product_is_the_per_group_one():
    """On a GPU the experts' products run as one batched product over padded groups
    (``padded_grouped_linear``): the same values and gradients as a product per group, here on
    the CPU, with empty groups and one larger than the rest."""
    from hosted_tinker.rank.experts import grouped_linear, padded_grouped_linear

    counts = [3, 0, 7, 1, 0, 2]
    x = torch.randn(sum(counts), 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(len(counts), 5, 16, dtype=torch.float64, requires_grad=True)
    looped = grouped_linear(x, weight, counts)  # the CPU's
    grads = torch.autograd.grad(looped.square().sum(), (x, weight))
    padded = padded_grouped_linear(x, weight, counts)
    torch.testing.assert_close(padded, looped, rtol=0, atol=1e-12)
    for got, want in zip(torch.autograd.grad(padded.square().sum(), (x, weight)), grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_joint_pass_never_gives_one_models_experts_to_another(rank: Rank):
    """Three models in one pass: ranks 4 and 8 (so scales 8 and 4) around one without expert LoRA
    (attention only). Each token goes through its own model's experts only, the middle model's
    through the base experts: every model's log-probs and gradients are what it gets alone."""
    model: HfLoraModel = rank.trainer.model
    a = trained_looking(model, LoraSpec(rank=4, seed=9, train_unembed=False))
    plain = trained_looking(model, LoraSpec(rank=4, seed=10, train_mlp=False, train_unembed=False))
    c = trained_looking(model, LoraSpec(rank=8, seed=11, train_unembed=False))
    handles = (a, plain, c)
    try:
        data = [datum(list(range(3, 20))), datum(list(range(30, 45))), datum(list(range(50, 61)))]
        joint = model.logprobs(list(handles), data)
        params = [p for h in handles for p in h.params]
        joint_grads = torch.autograd.grad(sum(lp.sum() for lp in joint), params)
        alone, alone_grads = [], []
        for h, d in zip(handles, data, strict=True):
            alone.append(model.logprobs([h], [d])[0])
            alone_grads += torch.autograd.grad(alone[-1].sum(), h.params)
        for got, want in zip(joint, alone, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        for got, want in zip(joint_grads, alone_grads, strict=True):
            assert_close_in_float32(got, want)
    finally:
        for h in handles:
            model.remove_adapter(h)


def test_no_tokens_is_no_output(rank: Rank):
    name = next(iter(rank.trainer.model.adapters.experts))
    experts = rank.trainer.model.base.get_submodule(name)
    out = experts(torch.zeros(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 64)


# ---- the service's routing metrics ---------------------------------------------------------------


def test_routing_metrics_are_the_sdks_documented_ones():
    """``ForwardBackwardOutput``'s documentation defines five MoE metrics; here they are by hand
    for two layers of four experts (8 assignments each, so a perfect balance of 2)."""
    from hosted_tinker.core.routing import routing_metrics

    counts = np.array([[2, 2, 2, 2], [5, 3, 0, 0]])
    assert routing_metrics(counts) == pytest.approx(
        {
            "e_frac_with_tokens:mean": (1.0 + 0.5) / 2,
            "e_frac_oversubscribed:mean": (0.0 + 0.5) / 2,
            "e_max_violation:mean": (0.0 + 1.5) / 2,  # (5 - 2) / 2
            "e_max_violation:max": 1.5,
            "e_min_violation:mean": (0.0 - 1.0) / 2,  # (0 - 2) / 2
        }
    )
    assert routing_metrics(np.zeros((2, 4))) == {}


def test_the_trainer_counts_each_requests_routing_once(rank: Rank):
    """Each request's routed tokens, counted in the forward pass only (not again when layers are
    recomputed), per model in a joint pass, are the base router's choices for its tokens (a new
    adapter changes nothing) and add up to tokens × experts per token in every layer."""
    trainer = rank.trainer
    for name in ("r1", "r2"):
        trainer.create_adapter(name, LoraSpec(rank=4, seed=12))
    threshold, trainer.recompute_above_tokens = trainer.recompute_above_tokens, 0  # every layer recomputed
    try:
        a, b = datum(list(range(4, 30))), datum(list(range(40, 49)))
        joint = trainer.forward_backward_many([("r1", one_datum_batch(a)), ("r2", one_datum_batch(b))])
        for result, d in zip(joint, (a, b), strict=True):
            np.testing.assert_array_equal(result.routed.counts, base_routing(trainer.model, d))
            assert (result.routed.counts.sum(axis=1) == d.num_tokens * 2).all()
            assert result.routed.routings == d.num_tokens * len(result.routed.counts)  # tokens × layers
            assert result.routed.replayed == result.routed.changed == 0  # nothing recorded to replay
    finally:
        trainer.recompute_above_tokens = threshold
        for name in ("r1", "r2"):
            trainer.delete_adapter(name)


def one_datum_batch(d: DatumInput):
    from hosted_tinker.core.types import ForwardBackwardBatch

    return ForwardBackwardBatch(data=[d], loss_fn="cross_entropy", loss_config={}, forward_only=False)


def base_routing(model: HfLoraModel, data: DatumInput) -> np.ndarray:
    """The tokens each expert of each layer gets from the base model's own routers, one sequence."""
    base = copy.deepcopy(model.shareable_base)
    counts = []
    hooks = [
        module.register_forward_pre_hook(
            lambda m, args: counts.append(np.bincount(args[1].reshape(-1).numpy(), minlength=m.num_experts))
        )
        for name, module in base.named_modules()
        if name in model.adapters.experts
    ]
    with torch.no_grad():
        base(input_ids=data.tokens[None])
    for h in hooks:
        h.remove()
    return np.stack(counts)


def test_one_tenant_routing_everything_to_one_expert_gets_no_padded_slab():
    """On a GPU a padded grouped product costs experts × the largest group: a batch whose tokens
    all go to one expert (one tenant can send 16K copies of a token) would need experts × tokens
    rows. Past ``MAX_PADDING`` times the rows the product goes group by group instead."""
    from hosted_tinker.rank.experts import MAX_PADDING, padding_pays

    assert padding_pays([130, 120, 125, 140] * 32)  # balanced routing over 128 experts
    assert not padding_pays([16384 * 8] + [0] * 127)  # everything to one expert
    assert not padding_pays([0] * 255 + [1000, 1000])  # two spans × 128 experts, one group busy
    assert MAX_PADDING <= 4


def test_experts_kept_as_separate_linear_layers_are_found_and_the_lineups_have_none(rank: Rank):
    """A model whose experts are linear layers of their own would get a 2-D LoRA per expert, not
    Tinker's layout: ``HfLoraModel`` refuses it by ``separate_expert_linears``' answer."""
    from torch import nn

    from hosted_tinker.rank.experts import separate_expert_linears

    assert separate_expert_linears(rank.trainer.model.base) == []
    block = nn.Module()
    block.experts = nn.ModuleList(nn.ModuleDict({"gate_proj": nn.Linear(4, 4)}) for _ in range(2))
    block.shared_expert = nn.Linear(4, 4)
    assert separate_expert_linears(block) == ["experts.0.gate_proj", "experts.1.gate_proj"]
