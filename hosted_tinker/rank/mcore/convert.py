"""A Hugging Face checkpoint as megatron-core's ``GPTModel``: what of its config shapes the model
(``HfShape``) and megatron's ``TransformerConfig`` for it; its layer specs are ``specs``'s, each
rank's shards of its weights ``weights``'s.

Megatron's fused layouts, for tensor-parallel rank ``r`` of ``tp``:

- ``linear_qkv``: query group by query group, each ``[q heads of the group; k; v]`` (head_dim
  rows each); rank ``r`` holds groups ``[r·G/tp, (r+1)·G/tp)``.
- ``linear_fc1``: ``[gate rows of rank r; up rows of rank r]`` (its SwiGLU splits the output in two).
- ``linear_proj`` / ``linear_fc2`` (row-parallel): columns ``[r·in/tp, (r+1)·in/tp)``.
- ``word_embeddings`` / ``output_layer`` (vocab-parallel): rows ``[r·V/tp, (r+1)·V/tp)``.

A mixture-of-experts layer (Qwen3-MoE, DeepSeek-V3) is megatron's ``MoELayer``: its router is
HF's ``gate``, and of the ``E`` routed experts expert-parallel rank ``q`` of ``ep`` holds
``[q·E/ep, (q+1)·E/ep)``, each a megatron ``MLP`` (``SequentialMLP``) whose ``linear_fc1`` is
``[gate; up]`` as above; DeepSeek's shared experts are one tensor-parallel ``MLP`` beside them
(``shared_experts``). DeepSeek-V3's attention is ``latent``'s; Qwen3.5 / 3.6's linear
attention, gated attention and norms are ``hybrid``'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hosted_tinker.rank.mcore.hybrid import Hybrid
from hosted_tinker.rank.mcore.latent import Latent, Yarn

DEEPSEEK = "DeepseekV3ForCausalLM"  # DeepSeek-V3 / V3.1, Kimi-K2 (their text model)
GPT_OSS = "GptOssForCausalLM"
# Qwen3.5 / 3.6: every released checkpoint is a vision-language one (its text model trains here)
QWEN3_5 = (
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
)
ARCHS = (
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    DEEPSEEK,
    GPT_OSS,
    *QWEN3_5,
    "Qwen2ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
)
MOE_ARCHS = ("Qwen3MoeForCausalLM", DEEPSEEK, GPT_OSS, *QWEN3_5[1::2])  # of ARCHS, the mixture-of-experts ones


@dataclass(frozen=True)
class HfShape:
    """What of the HF config decides the megatron model and its sharding."""

    arch: str
    family: str  # the config's model_type
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k
    qkv_bias: bool  # Qwen2
    rms_eps: float
    rope_theta: float
    max_positions: int
    experts: int = 0  # routed experts per layer (0: a dense model)
    moe_ffn: int = 0  # each expert's intermediate size
    top_k: int = 0  # experts per token
    norm_topk: bool = False  # the top-k routing weights renormalised to sum to 1
    # DeepSeek's routing: sigmoid scores, a bias added for the choice alone, the top groups of
    # experts first, the weights scaled
    score: str = "softmax"  # or "sigmoid"
    expert_bias: bool = False
    groups: int = 0  # n_group (0: no group-limited routing)
    group_top_k: int = 0  # topk_group
    route_scale: float = 1.0  # routed_scaling_factor
    shared_ffn: int = 0  # the shared experts' intermediate size (0: none)
    dense_layers: int = 0  # the first layers' MLPs are dense (first_k_dense_replace)
    latent: Latent | None = None  # multi-head latent attention (``latent``)
    yarn: Yarn | None = None  # YaRN rotary scaling (DeepSeek's, gpt-oss's)
    # gpt-oss: biases on every linear layer (attention, experts, router), attention sinks, a
    # sliding window on some layers, a clamped SwiGLU with a linear offset of 1
    biases: bool = False
    sinks: bool = False
    windows: tuple[int, ...] = ()  # each layer's sliding window (0: none); () for none anywhere
    swiglu_limit: float = 0.0  # the clamp (0: a plain SwiGLU)
    # Qwen3.5 / 3.6: Gated-DeltaNet layers, output-gated attention, a gated shared expert
    hybrid: Hybrid | None = None
    attention_gate: bool = False
    shared_gate: bool = False
    shared_hf: str = "shared_experts"  # the HF module of the shared experts (Qwen3.5: shared_expert)

    @classmethod
    def read(cls, model_path: str) -> HfShape:
        config: dict[str, Any] = json.loads((Path(model_path) / "config.json").read_text())
        arch = (config.get("architectures") or ["?"])[0]
        if arch not in ARCHS:
            raise ValueError(f"the megatron backend loads {', '.join(ARCHS)}; {model_path} is {arch}")
        whole = config
        if arch in QWEN3_5:
            config = cls._qwen3_5_text(whole, arch)
        # (a vision-language checkpoint's at the top, beside its text config)
        if quantized := (whole.get("quantization_config") or config.get("quantization_config") or {}).get(
            "quant_method"
        ):
            raise ValueError(
                f"the megatron backend loads unquantized weights; {model_path} is quantized ({quantized}): "
                "convert it to bfloat16 first"
            )
        if (act := config.get("hidden_act", "silu")) != "silu":
            raise ValueError(f"the megatron backend converts SiLU-gated MLPs; {model_path}'s hidden_act is {act}")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        max_positions = config.get("max_position_embeddings") or 32768
        if arch not in (DEEPSEEK, GPT_OSS) and rope.get("rope_type", rope.get("type", "default")) not in (
            "default",
            None,
        ):
            raise ValueError(f"the megatron backend does not convert {arch}'s rope scaling {rope}")
        heads = config["num_attention_heads"]
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        if experts and (config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1):
            raise ValueError(
                f"the megatron backend converts Qwen3-MoE models whose every layer is one; {model_path} "
                f"has dense layers (mlp_only_layers, decoder_sparse_step)"
            )
        fields: dict[str, Any] = dict(
            arch=arch,
            family=whole.get("model_type", ""),  # the checkpoint's, as peft names it
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            ffn=config.get("intermediate_size") or 0,  # none in a MoE model without dense layers (Qwen3.5-MoE)
            vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            qkv_bias=bool(config.get("attention_bias", arch == "Qwen2ForCausalLM")),
            rms_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            max_positions=max_positions,
            experts=experts,
            moe_ffn=config.get("moe_intermediate_size") or 0,
            top_k=config.get("num_experts_per_tok") or 0,
            norm_topk=bool(config.get("norm_topk_prob", False)),
        )
        if arch == DEEPSEEK:
            fields.update(cls._deepseek(config, model_path))
        if arch == GPT_OSS:
            fields.update(cls._gpt_oss(config, rope, max_positions, model_path))
        if arch in QWEN3_5:
            fields.update(cls._qwen3_5(config, model_path))
        return cls(**fields)

    @staticmethod
    def _qwen3_5_text(whole: dict[str, Any], arch: str) -> dict[str, Any]:
        """A Qwen3.5 checkpoint's text config as transformers reads it: its defaults for what the
        file leaves out (``head_dim`` 256, ``partial_rotary_factor`` 0.25, ``layer_types`` from
        ``full_attention_interval``), a vision-language checkpoint's ``text_config`` with the head
        tied by the whole model's flag."""
        import transformers

        text = whole.get("text_config", whole)
        kind = transformers.Qwen3_5MoeTextConfig if arch in MOE_ARCHS else transformers.Qwen3_5TextConfig
        tied = bool(whole.get("tie_word_embeddings") or text.get("tie_word_embeddings"))  # either ties, as on peft
        return kind.from_dict(text).to_dict() | {"tie_word_embeddings": tied}

    @staticmethod
    def _qwen3_5(config: dict[str, Any], model_path: str) -> dict[str, Any]:
        """Qwen3.5 / 3.6's fields: Gated-DeltaNet layers (``hybrid``), q/k norms and an output gate
        on the full-attention layers; the MoE models' router renormalises its top k always (HF's
        ``Qwen3_5MoeTopKRouter``), their one shared expert's output gated by a sigmoid."""
        shared = config.get("shared_expert_intermediate_size") or 0
        return dict(
            hybrid=Hybrid.read(config, model_path),
            qk_norm=True,
            attention_gate=True,
            norm_topk=True,
            shared_ffn=shared,
            shared_gate=bool(shared),
            shared_hf="shared_expert",
        )

    @staticmethod
    def _gpt_oss(config: dict[str, Any], rope: dict[str, Any], max_positions: int, model_path: str) -> dict[str, Any]:
        """gpt-oss's fields beyond the common ones. Its SwiGLU is megatron's ``quick_gelu``
        (``x·sigmoid(1.702·x)``) gated with a linear offset of 1, both halves clamped as HF's; its
        router softmaxes the top k logits (megatron's ``pre_softmax`` off)."""
        if (alpha := config.get("swiglu_alpha", 1.702)) != 1.702:
            raise ValueError(f"the megatron backend converts gpt-oss's SwiGLU with alpha 1.702; {model_path}: {alpha}")
        kinds = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
        window = config.get("sliding_window") or 0
        yarn = Yarn.read(rope, max_positions, model_path) if rope.get("rope_type") == "yarn" else None
        if yarn is not None and yarn.mscale_all_dim:
            raise ValueError(
                f"the megatron backend converts gpt-oss's YaRN without mscale_all_dim; {model_path} has it"
            )
        return dict(
            moe_ffn=config["intermediate_size"],  # each expert's; gpt-oss has no dense MLP
            norm_topk=True,
            biases=True,
            qkv_bias=True,
            sinks=True,
            windows=tuple(window if kind == "sliding_attention" else 0 for kind in kinds),
            swiglu_limit=float(config.get("swiglu_limit") or 0.0),
            yarn=yarn,
        )

    @staticmethod
    def _deepseek(raw: dict[str, Any], model_path: str) -> dict[str, Any]:
        """DeepSeek-V3's fields (read as transformers' config reads them: its defaults for what
        the file leaves out), or why megatron-core's router cannot route as HF's does: it
        renormalises sigmoid weights only for top k > 1 but always then, and ranks groups by the
        sum of each one's top ``top_k / topk_group`` scores where HF sums the top two."""
        from transformers import DeepseekV3Config

        config: Any = DeepseekV3Config.from_dict(raw)  # untyped: its attributes are set from the file
        top_k, groups, group_top_k = config.num_experts_per_tok, config.n_group or 1, config.topk_group or 1
        if config.norm_topk_prob != (top_k > 1):
            raise ValueError(
                f"the megatron backend routes DeepSeek-V3 with norm_topk_prob exactly where num_experts_per_tok > 1; "
                f"{model_path} has norm_topk_prob={config.norm_topk_prob} and {top_k}"
            )
        if groups > 1 and top_k != 2 * group_top_k:
            raise ValueError(
                f"the megatron backend routes DeepSeek-V3's groups as HF does only where num_experts_per_tok is twice "
                f"topk_group; {model_path} has {top_k} and {group_top_k}"
            )
        rope = config.rope_parameters
        yarn = Yarn.read(rope, config.max_position_embeddings, model_path) if rope["rope_type"] == "yarn" else None
        if yarn is None and rope["rope_type"] != "default":
            raise ValueError(f"the megatron backend does not convert DeepSeek-V3's rope scaling {rope}")
        if yarn is not None and not yarn.truncate:  # megatron's latent attention always truncates
            raise ValueError(f"the megatron backend converts DeepSeek-V3's YaRN truncated; {model_path} sets truncate")
        return dict(
            experts=config.n_routed_experts,
            moe_ffn=config.moe_intermediate_size,
            top_k=top_k,
            norm_topk=config.norm_topk_prob,
            score="sigmoid",
            expert_bias=True,
            groups=groups if groups > 1 else 0,
            group_top_k=group_top_k if groups > 1 else 0,
            route_scale=float(config.routed_scaling_factor),
            shared_ffn=(config.n_shared_experts or 0) * config.moe_intermediate_size,
            dense_layers=config.first_k_dense_replace,
            latent=Latent.read(config, model_path),
            yarn=yarn,
            rope_theta=rope["rope_theta"],
        )

    def moe(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is a mixture-of-experts one."""
        return bool(self.experts) and layer >= self.dense_layers

    def window(self, layer: int) -> int:
        """Decoder layer ``layer``'s sliding window (0: it attends to all before)."""
        return self.windows[layer] if self.windows else 0

    def linear(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is a Gated-DeltaNet (linear attention) one."""
        return self.hybrid is not None and self.hybrid.linear[layer]

    @property
    def causal_lm(self) -> str:
        """The class that trains, as the peft backend names it: a vision-language checkpoint's
        text model's (``Qwen3_5MoeForConditionalGeneration`` -> ``Qwen3_5MoeForCausalLM``)."""
        return self.arch.replace("ForConditionalGeneration", "ForCausalLM")

    @property
    def te_layers(self) -> bool:
        """Whether ``layers=te`` builds this model: not latent attention, nor linear attention."""
        return self.latent is None and self.hybrid is None

    def check_tp(self, tp: int) -> None:
        """``tp`` must divide every dimension megatron splits; else say which does not."""
        for what, n in (("attention heads", self.heads), ("kv heads", self.kv_heads), ("vocab_size", self.vocab)):
            if n % tp:
                raise ValueError(f"--backend-option tp={tp} does not divide the model's {what} ({n})")
        for what, n in (("intermediate_size", self.ffn), ("shared experts' intermediate size", self.shared_ffn)):
            if n % tp:
                raise ValueError(f"--backend-option tp={tp} does not divide the model's {what} ({n})")
        if self.hybrid is not None:
            self.hybrid.check_tp(tp)

    def check_ep(self, ep: int, tp: int = 1, sequence_parallel: bool = False) -> None:
        """``ep`` must divide the routed experts, and there must be some; and a mixture-of-experts
        model under ``tp`` > 1 needs sequence parallelism (megatron's MoE layer routes each
        tensor-parallel rank's part of the sequence; without it every rank would route them all)."""
        if ep > 1 and not self.experts:
            raise ValueError(f"--backend-option ep={ep} needs a mixture-of-experts model; {self.arch} has no experts")
        if self.experts % ep:
            raise ValueError(f"--backend-option ep={ep} does not divide the model's {self.experts} routed experts")
        if self.experts and tp > 1 and not sequence_parallel:
            raise ValueError(
                f"--backend-option tp={tp} on a mixture-of-experts model needs sequence_parallel=true: "
                "megatron-core's MoE layers route each tensor-parallel rank's part of the sequence"
            )
        if self.latent is not None and tp > 1 and not sequence_parallel:
            raise ValueError(  # its rotary key is gathered over the sequence, whose backward sums the heads' shares
                f"--backend-option tp={tp} on latent attention needs sequence_parallel=true"
            )


def transformer_config(shape: HfShape, tp: int, dtype: torch.dtype, sequence_parallel: bool = False, ep: int = 1):
    """megatron-core's ``TransformerConfig`` for ``shape``: the plain-PyTorch (local) path, no
    fusions, no dropout, so that it computes what the HF model computes (latent attention's:
    ``MLATransformerConfig``)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    config, latent = TransformerConfig, {}
    if shape.latent is not None:
        config, latent = MLATransformerConfig, shape.latent.config_fields(shape.yarn, shape.rope_theta)
    activation = gpt_oss_config(shape) if shape.biases else dict(activation_func=F.silu, add_bias_linear=False)
    made = config(
        **(moe_config(shape, ep) if shape.experts else {}),
        **latent,
        **activation,
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_eps,
        qk_layernorm=shape.qk_norm,
        attention_output_gate=shape.attention_gate,
        gated_linear_unit=True,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        perform_initialization=False,  # every weight is loaded below
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
    )
    if shape.yarn is not None and shape.latent is None:
        for name, value in shape.yarn.gpt_fields().items():
            setattr(made, name, value)
    return made


def gpt_oss_config(shape: HfShape) -> dict[str, Any]:
    """gpt-oss's ``TransformerConfig`` fields: biases on every linear layer (megatron's output
    layer takes none, nor does HF's); attention sinks, megatron's learnable softmax offset; its
    SwiGLU. (YaRN's attention factor on cos and sin: megatron's attention reads it from the
    ``yarn_*`` attributes, ``Yarn.gpt_fields``.)"""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return dict(
        add_bias_linear=True,
        softmax_type="learnable",
        activation_func=quick_gelu,
        glu_linear_offset=1.0,
        activation_func_clamp_value=shape.swiglu_limit or None,
    )


def moe_config(shape: HfShape, ep: int) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of a mixture-of-experts layer that routes as HF's does:
    softmax over the experts, the top k, renormalised (``norm_topk_prob``: megatron's softmax over
    the top k's logits is the same) or not (``pre_softmax``: the top k of the softmax over all);
    no load-balancing loss (Tinker's loss is the user's); the router's logits in the model's dtype,
    as HF's ``F.linear`` (its softmax is float32 in both). With ``norm_topk_prob`` the experts
    chosen are then HF's exactly (the top k of the logits); without, megatron takes the top k of
    the softmax rounded to the model's dtype, HF of the float32 one: a 16-bit base may part from HF
    at a near tie. Tokens reach the experts by all-gather
    over the tensor×expert-parallel group (``allgather``: plain collectives, gloo's too; megatron's
    ``alltoall`` makes a CUDA stream when built), and each expert is its own ``MLP``
    (``SequentialMLP``: no grouped-GEMM kernel to install).

    DeepSeek's router (``score`` sigmoid) is HF's in float32: sigmoid scores, the checkpoint's
    ``e_score_correction_bias`` added for the choice alone (megatron's expert bias, which only its
    training loop would update), the best ``topk_group`` of ``n_group`` groups first, the chosen
    scores renormalised and scaled by ``routed_scaling_factor``; its shared experts one ``MLP``
    beside the routed ones, and its first ``first_k_dense_replace`` layers dense."""
    return dict(
        num_moe_experts=shape.experts,
        moe_ffn_hidden_size=shape.moe_ffn,
        moe_router_topk=shape.top_k,
        moe_router_pre_softmax=not shape.norm_topk,
        moe_router_score_function=shape.score,
        moe_router_enable_expert_bias=shape.expert_bias,
        moe_router_num_groups=shape.groups or None,
        moe_router_group_topk=shape.group_top_k or None,
        moe_router_topk_scaling_factor=shape.route_scale if shape.route_scale != 1.0 else None,
        moe_shared_expert_intermediate_size=shape.shared_ffn or None,
        moe_shared_expert_gate=shape.shared_gate,
        moe_layer_freq=[int(shape.moe(i)) for i in range(shape.layers)],
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32" if shape.score == "sigmoid" else None,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,  # each expert whole on its ranks (``rank.mcore.experts``)
    )
