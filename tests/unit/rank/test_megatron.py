"""The unit tests of what tests/e2e/test_megatron.py tests end to end (no server here)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast


def test_layers_auto_picks_transformer_engine_for_16_bit_gpu_ranks_only(monkeypatch) -> None:
    from hosted_tinker.rank.plans import options

    monkeypatch.setattr(options, "has_transformer_engine", lambda: True)
    auto = options.MegatronOptions(tp=1)
    assert auto.uses_te("cuda:0", "bfloat16") and auto.uses_te("cuda:1", "float16")
    assert not auto.uses_te("cuda:0", "float32") and not auto.uses_te("cpu", "bfloat16")
    assert options.MegatronOptions(tp=1, layers="te").uses_te("cuda:0", "float32")  # asked for: as asked
    assert not auto.uses_te("cuda:0", "bfloat16", te_layers=False)  # none for latent or linear attention
    assert not options.MegatronOptions(tp=1, layers="local").uses_te("cuda:0", "bfloat16")
    monkeypatch.setattr(options, "has_transformer_engine", lambda: False)
    assert not auto.uses_te("cuda:0", "bfloat16")


def test_a_megatron_core_it_was_not_built_on_is_refused_at_start_up(monkeypatch) -> None:
    """pip gives Python 3.12 the newest megatron-core, whose layer specs rank.mcore cannot read:
    the start is refused, naming the installed release and the pip command, not a rank's traceback."""
    from hosted_tinker.rank.plans import options, plan_options

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # as if installed
    monkeypatch.setattr(options.importlib.metadata, "version", lambda dist: "0.19.2")
    with pytest.raises(ValueError, match=r"not the installed 0\.19\.2: pip install 'megatron-core<0\.17,>=0\.16\.1'"):
        plan_options("megatron", {"tp": "2"}, ["cpu", "cpu"], 3600.0)
    monkeypatch.setattr(options.importlib.metadata, "version", lambda dist: "0.16.1")
    assert plan_options("megatron", {"tp": "2"}, ["cpu", "cpu"], 3600.0).tp == 2

    def not_installed(dist: str) -> str:
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(options.importlib.metadata, "version", not_installed)  # a Megatron-LM checkout
    with pytest.raises(ValueError, match="importable but no megatron-core package is installed"):
        plan_options("megatron", {"tp": "2"}, ["cpu", "cpu"], 3600.0)


def test_the_pins_are_the_ones_pyproject_installs() -> None:
    """One release of each engine, said twice (pyproject's extras, and where the code checks or
    installs it): the two must not drift apart."""
    import tomllib

    from packaging.requirements import Requirement

    from hosted_tinker.inference.vllm_setup import VLLM_CUDA_SPEC
    from hosted_tinker.rank.plans.options import MCORE_SUPPORTED

    extras = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    assert Requirement(extras["megatron"][0]).specifier == MCORE_SUPPORTED
    assert Requirement(extras["vllm"][0]) == Requirement(VLLM_CUDA_SPEC)


def test_expert_parallelism_is_checked_before_a_rank_starts_or_as_the_model_loads(monkeypatch, tiny_model_dir) -> None:
    """ep and tp must each divide the ranks (the experts are not split over tp's ranks); ep takes
    the token threshold (a memory budget is measured per rank, on passes of unequal length), needs
    a model with routed experts, and with tp > 1 sequence parallelism: said in one line (what
    `serve` prints), as the rest of the megatron options."""
    from hosted_tinker.rank.mcore.convert import HfShape
    from hosted_tinker.rank.plans import options, plan_options

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # as if installed
    monkeypatch.setattr(options.importlib.metadata, "version", lambda dist: "0.16.1")
    with pytest.raises(ValueError, match=r"ep=4 does not divide the 2 ranks of --train-devices"):
        plan_options("megatron", {"tp": "2", "ep": "4"}, ["cpu"] * 2, 3600.0)
    with pytest.raises(ValueError, match=r"tp=4 does not divide the 2 ranks of --train-devices"):
        plan_options("megatron", {"tp": "4", "ep": "2"}, ["cpu"] * 2, 3600.0)
    plan_options("megatron", {"tp": "2", "ep": "4", "sequence_parallel": "true"}, ["cpu"] * 4, 3600.0)
    with pytest.raises(ValueError, match=r"tp=2 and ep=3: one must divide the other"):
        plan_options("megatron", {"tp": "2", "ep": "3", "sequence_parallel": "true"}, ["cpu"] * 6, 3600.0)
    with pytest.raises(ValueError, match=r"activation_memory_gib is not built for ep > 1"):
        plan_options("megatron", {"ep": "2", "activation_memory_gib": "1"}, ["cpu"] * 2, 3600.0)
    assert plan_options("megatron", {"ep": "2"}, ["cuda:0", "cuda:1"], 3600.0).activation_budget(["cuda:0"]) is None
    with pytest.raises(ValueError, match=r"ep=2 needs a mixture-of-experts model; Qwen3ForCausalLM has no experts"):
        HfShape.read(str(tiny_model_dir)).check_ep(2)
    moe = dataclasses.replace(HfShape.read(str(tiny_model_dir)), arch="Qwen3MoeForCausalLM", experts=8)
    moe.check_ep(4)  # two experts a rank
    with pytest.raises(ValueError, match=r"ep=3 does not divide the model's 8 routed experts"):
        moe.check_ep(3)
    with pytest.raises(ValueError, match=r"tp=2 on a mixture-of-experts model needs sequence_parallel=true"):
        moe.check_ep(2, tp=2)
    moe.check_ep(2, tp=2, sequence_parallel=True)
    moe.check_ep(1, tp=2, sequence_parallel=True)


# DeepSeek-V3's config.json, its widths cut (its routing, rotary and layer layout as released)
DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    num_hidden_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=192,
    moe_intermediate_size=32,
    vocab_size=512,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=3,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=163840,
    rope_scaling=dict(
        type="yarn",
        factor=40,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    rope_theta=10000,
)


def test_deepseek_reads_as_megatron_routes_and_rotates_it_or_is_refused_naming_why(tmp_path: Path) -> None:
    """DeepSeek-V3 (Kimi-K2's architecture) converts to megatron-core where its router and YaRN can
    compute what HF's do (``rank.mcore.latent``, ``convert.moe_config``); where they cannot, the
    model is refused at start, naming the setting, rather than trained as another model."""
    import json

    from hosted_tinker.rank.mcore.convert import HfShape
    from hosted_tinker.rank.mcore.latent import Latent, Yarn

    def read(**changes) -> HfShape:
        (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3 | changes))
        return HfShape.read(str(tmp_path))

    shape = read()
    assert shape.latent == Latent(q_rank=32, kv_rank=16, nope=8, rope=8, v=16)
    assert shape.yarn == Yarn(40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    assert [shape.moe(i) for i in range(4)] == [False, False, False, True]
    assert (shape.experts, shape.shared_ffn, shape.score, shape.expert_bias) == (8, 32, "sigmoid", True)
    assert (shape.groups, shape.group_top_k, shape.route_scale) == (8, 4, 2.5)
    assert read(q_lora_rank=None).latent.q_rank == 0  # DeepSeek-V2-Lite's one q_proj
    kimi = dict(DEEPSEEK_V3["rope_scaling"], factor=32.0)
    assert read(n_group=1, topk_group=1, rope_scaling=kimi).groups == 0  # Kimi-K2: no group limit
    no_all_dim = dict(DEEPSEEK_V3["rope_scaling"], mscale=0.707, mscale_all_dim=0)
    assert read(rope_scaling=no_all_dim).yarn.mscale == 1.0  # HF then scales cos/sin by get_mscale(factor)
    # what the file leaves out is transformers' default, as HF's model reads it
    terse = {k: v for k, v in DEEPSEEK_V3.items() if k not in ("n_shared_experts", "routed_scaling_factor")}
    (tmp_path / "config.json").write_text(json.dumps(terse))
    assert (HfShape.read(str(tmp_path)).shared_ffn, HfShape.read(str(tmp_path)).route_scale) == (32, 2.5)
    with pytest.raises(ValueError, match="tp=2 on a mixture-of-experts model needs sequence_parallel=true"):
        shape.check_ep(2, tp=2)
    dense = dataclasses.replace(shape, experts=0)
    with pytest.raises(ValueError, match="tp=2 on latent attention needs sequence_parallel=true"):
        dense.check_ep(1, tp=2)

    refused = [
        (dict(norm_topk_prob=False), "routes DeepSeek-V3 with norm_topk_prob"),
        (dict(n_group=4, topk_group=2), "num_experts_per_tok is twice topk_group; .* has 8 and 2"),
        (dict(rope_interleave=False), "sets rope_interleave=false"),
        (dict(quantization_config={"quant_method": "fp8"}), r"is quantized \(fp8\): convert it to bfloat16"),
        (dict(rope_scaling=dict(DEEPSEEK_V3["rope_scaling"], attention_factor=1.2)), "sets attention_factor"),
        (dict(rope_scaling=dict(DEEPSEEK_V3["rope_scaling"], truncate=False)), "YaRN truncated; .* sets truncate"),
        (dict(rope_scaling=dict(DEEPSEEK_V3["rope_scaling"], mscale=None)), "mscale_all_dim only beside mscale"),
        (dict(attention_bias=True), "latent attention without biases"),
        (dict(num_experts_per_tok=1, n_group=1), "norm_topk_prob exactly where num_experts_per_tok > 1"),
        (dict(hidden_act="gelu"), "SiLU-gated MLPs; .* hidden_act is gelu"),
    ]
    for changes, why in refused:
        with pytest.raises(ValueError, match=why):
            read(**changes)


def test_gpt_oss_reads_as_megatron_computes_it(tmp_path: Path) -> None:
    """gpt-oss's sinks, windows, YaRN (untruncated) and biases are read; a SwiGLU megatron's
    quick_gelu does not compute is refused at start, naming it."""
    import json
    from types import SimpleNamespace

    from hosted_tinker.core.tiny_model import tiny_config
    from hosted_tinker.rank.mcore.convert import HfShape

    tok = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    config = tiny_config("gpt_oss", vocab_size=512, hidden_size=64, num_layers=2, initializer_range=0.1, tok=tok)
    raw = config.to_dict() | {"architectures": ["GptOssForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    shape = HfShape.read(str(tmp_path))
    assert (shape.experts, shape.moe_ffn, shape.biases, shape.sinks) == (8, 32, True, True)
    assert shape.windows == (16, 0) and shape.yarn is not None and not shape.yarn.truncate
    shape.check_ep(2, tp=2, sequence_parallel=True)
    (tmp_path / "config.json").write_text(json.dumps(raw | {"swiglu_alpha": 1.5}))
    with pytest.raises(ValueError, match="SwiGLU with alpha 1.702"):
        HfShape.read(str(tmp_path))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_reads_as_its_text_model_with_linear_attention_or_is_refused_naming_why(
    tmp_path: Path, family: str
) -> None:
    """A Qwen3.5 / 3.6 checkpoint (vision-language) reads as its text model: Gated-DeltaNet layers
    where ``layer_types`` has them, output-gated attention with q/k norms, a partial rotary
    embedding, the MoE's gated shared expert; what is not converted is refused, naming it."""
    import json
    from types import SimpleNamespace

    from hosted_tinker.core.tiny_model import tiny_config
    from hosted_tinker.rank.mcore.convert import HfShape

    tok = SimpleNamespace(eos_token_id=2, pad_token_id=0, convert_tokens_to_ids=lambda tokens: [3, 4, 5, 6])
    config = tiny_config(family, vocab_size=512, hidden_size=64, num_layers=4, initializer_range=0.1, tok=tok)
    arch = "Qwen3_5MoeForConditionalGeneration" if family == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
    raw = config.to_dict() | {"architectures": [arch]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    shape = HfShape.read(str(tmp_path))
    assert shape.family == family and shape.attention_gate and shape.qk_norm
    assert shape.hybrid is not None and shape.hybrid.linear == (True, False, True, False)
    assert shape.hybrid.rotary_percent == 0.25 and not shape.te_layers
    assert shape.tied == (family == "qwen3_5")
    if family == "qwen3_5_moe":
        assert (shape.experts, shape.top_k, shape.norm_topk, shape.shared_ffn, shape.shared_gate) == (
            8,
            2,
            True,
            32,
            True,
        )
        shape.check_ep(2, tp=2, sequence_parallel=True)
    shape.check_tp(2)
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        shape.hybrid.check_tp(4)  # its linear attention's 2 key heads (the model's check names the first)
    text = raw["text_config"]
    # what a file leaves out is transformers' default: layer_types from full_attention_interval,
    # head_dim 256, the rotary fraction and base from the older top-level fields
    left_out = ("layer_types", "head_dim", "rope_parameters", "intermediate_size")  # a MoE one has no dense MLP
    legacy = {k: v for k, v in text.items() if k not in left_out}
    legacy |= {"full_attention_interval": 2, "rope_theta": 5e6, "partial_rotary_factor": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(raw | {"text_config": legacy}))
    read = HfShape.read(str(tmp_path))
    assert read.hybrid is not None and read.hybrid.linear == (True, False, True, False)
    assert (read.head_dim, read.rope_theta, read.hybrid.rotary_percent) == (256, 5e6, 0.5)
    (tmp_path / "config.json").write_text(json.dumps(raw | {"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match="quantized"):  # at the top of a vision-language config
        HfShape.read(str(tmp_path))
    for change, refused in (
        ({"rope_parameters": {**text["rope_parameters"], "rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
        ({"attention_bias": True}, "attention biases"),
    ):
        (tmp_path / "config.json").write_text(json.dumps(raw | {"text_config": text | change}))
        with pytest.raises(ValueError, match=refused):
            HfShape.read(str(tmp_path))
