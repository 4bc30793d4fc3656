"""Model shapes the benchmarks run with random weights, and the FLOPs a trained token costs.

FLOPs per token of a decoder with LoRA on attention and MLP (P: the matmul weights a token meets,
the output layer included; embedding lookups are free):

    model FLOPs   6·P + 3·attention_fwd      the usual convention for MFU
    LoRA step     4·P + 6·P_lora + 3·attention_fwd
                  what a LoRA step executes: the frozen base has no weight gradients (forward
                  2·P, input gradients 2·P), the adapters have all three

with attention_fwd = 4 · layers · (heads · head_dim) · context: scores and values over a causal
context of ``context`` positions on average (N/2 for one sequence of N, Σ N²/2 / Σ N for many).
Hybrid models (Qwen3.5): ``hybrid_flops_per_token``; mixture of experts: ``moe_flops_per_token``
(P counts the parameters a token meets: its top-k experts, not all of them); DeepSeek-V3 and
Kimi-K2 (latent attention, dense first layers, shared experts): ``latent_flops_per_token``.
Recomputed activations are not counted: MFU is of the model's FLOPs, not of the work done.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The CPU-sized Qwen3.5 shapes' attention (1 gated full-attention layer to 3 Gated-DeltaNet ones),
# width and vocabulary, dense or MoE
QWEN3_5_CPU = {
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "vocab_size": 8192,
    "max_position_embeddings": 40960,
}
# Model shapes to benchmark with random weights (``--shape``), as their HF configs give them.
SHAPES = {
    # issue #20's long-sequence model: Qwen3's vocabulary and head layout, hidden 1024, 4 layers
    "qwen3-h1024-l4": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    },
    # a small Qwen3 for CPU scenarios: its output layer is about a quarter of its matmul weights
    "qwen3-h512-l4": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 8192,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    },
    # Qwen2.5-0.5B's shape (issue #20: the 8-tenant figure "for a 0.5B-shaped model")
    "qwen-0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
    },
    # Qwen3.5's hybrid layout (issue #40): three Gated-DeltaNet layers to one gated full-attention
    # layer. A CPU-sized one, and Qwen3.5-9B's language model (the cookbook's default) for a GPU.
    "qwen3.5-h512-l4": {
        "model_type": "qwen3_5_text",
        **QWEN3_5_CPU,
        "intermediate_size": 1536,
        "tie_word_embeddings": True,
    },
    "qwen3.5-9b": {"model_type": "qwen3_5_text", "vocab_size": 248320, "max_position_embeddings": 40960},
    # Qwen3.5-35B-A3B's language model (transformers' defaults for its text config: 40 layers of
    # 256 routed experts, 8 per token, and a gated shared expert), and a CPU-sized one of its make
    "qwen3.5-35b-a3b": {"model_type": "qwen3_5_moe_text", "max_position_embeddings": 40960},
    "qwen3.5-moe-h512-l4": {
        "model_type": "qwen3_5_moe_text",
        **QWEN3_5_CPU,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
        "tie_word_embeddings": False,
    },
    # Qwen3-30B-A3B (issue #42): 48 layers of 128 routed experts, 8 per token; its first two layers
    # (the whole width: 1.2 B parameters a layer) for a CPU run or a GPU that holds no more; and a
    # CPU-sized one of the same make
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
    },
    # 8 of its 32 layers (6 linear, 2 full), for a GPU check that writes and loads it within a section
    "qwen3.5-9b-l8": {
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 8,
        "vocab_size": 248320,
        "max_position_embeddings": 40960,
    },
}
SHAPES["qwen3-30b-a3b-l2"] = {**SHAPES["qwen3-30b-a3b"], "num_hidden_layers": 2}
# DeepSeek-V3 / V3.1 (671B-A37B) and Kimi-K2 (1T-A32B), as their configs give them: for their FLOPs
# per token (MFU on a GPU that holds a cut of them); and a CPU-sized one of the same make
SHAPES["deepseek-v3"] = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
}
SHAPES["kimi-k2"] = {
    **SHAPES["deepseek-v3"],
    "num_hidden_layers": 61,
    "first_k_dense_replace": 1,
    "n_routed_experts": 384,
    "n_group": 1,
    "topk_group": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "vocab_size": 163840,
}
SHAPES["deepseek-h512-l4"] = {  # one dense layer, three of 16 experts of 256 (4 a token) and a shared one
    **SHAPES["deepseek-v3"],
    "hidden_size": 512,
    "intermediate_size": 1536,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "vocab_size": 32000,
}
SHAPES["qwen3-moe-h512-l4"] = {  # the small Qwen3 with 16 experts of 256, 4 a token, in place of its MLP
    **SHAPES["qwen3-h512-l4"],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 256,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}


MODEL_CACHE = Path.home() / ".cache" / "hosted-tinker" / "bench-models"


def random_model(shape: str, dtype: str, root: Path = MODEL_CACHE, layers: int | None = None) -> str:
    """A model folder of ``SHAPES[shape]`` (cut to ``layers`` decoder layers if given) with
    random weights in ``dtype`` (and the tiny tokenizer: the benchmark feeds token ids), written
    once and reused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[shape])
    name = shape
    if layers is not None:
        fields["num_hidden_layers"], name = layers, f"{shape}-l{layers}"
    config = AutoConfig.for_model(fields.pop("model_type", "qwen3"), **fields, dtype=dtype)
    return write_random_model(AutoModelForCausalLM.from_config, config, root / f"{name}-random-{dtype}")


def write_random_model(model_class: Callable[[Any], Any], config: Any, out: Path) -> str:
    """``model_class(config)`` with seeded random weights (drawn on the GPU where there is one) and
    the tiny tokenizer, written to ``out`` once (a folder there already is the same model)."""
    import torch

    from hosted_tinker.core.tiny_model import build_tokenizer

    if (out / "config.json").exists():
        return str(out)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, str(config.dtype).removeprefix("torch.")))
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = model_class(config)
    finally:
        torch.set_default_dtype(default)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    build_tokenizer().save_pretrained(tmp)
    tmp.rename(out)
    del model
    if torch.cuda.is_available():  # the workers load it; this process must not keep its 16 GB cached
        torch.cuda.empty_cache()
    return str(out)


def vocab_size(model: str) -> int:
    """The vocabulary of the model folder ``model`` (its config.json)."""
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def flops_per_token(model: str, mean_context: float, lora_rank: int) -> dict[str, float]:
    """FLOPs per trained token of the HF model at ``model`` (see the module docstring)."""
    c = json.loads((Path(model) / "config.json").read_text())
    if "linear_attention" in (c.get("layer_types") or []):
        return hybrid_flops_per_token(c, mean_context, lora_rank)
    if c.get("kv_lora_rank"):
        return latent_flops_per_token(c, mean_context, lora_rank)
    if c.get("num_experts") or c.get("num_local_experts"):  # transformers 5 writes the latter
        return moe_flops_per_token(c, mean_context, lora_rank)
    hidden, layers, ffn, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    q, kv_out = heads * head_dim, kv * head_dim
    per_layer = hidden * (q + 2 * kv_out) + q * hidden + 3 * hidden * ffn
    params = layers * per_layer + vocab * hidden  # the output layer; embedding lookups are free
    # A (r x in) and B (out x r) of q, k, v, o, gate, up, down
    lora = layers * lora_rank * (3 * hidden + q + 2 * kv_out + q + hidden + 2 * (hidden + ffn) + ffn + hidden)
    attention_fwd = 4 * layers * q * mean_context  # scores and values, a causal context of mean_context
    return {
        "matmul_params": params,
        "lora_params": lora,
        "model_flops_6p": 6 * params + 3 * attention_fwd,
        "lora_step_flops": 4 * params + 6 * lora + 3 * attention_fwd,
    }


def moe_flops_per_token(c: dict[str, Any], mean_context: float, lora_rank: int) -> dict[str, float]:
    """``flops_per_token`` of a Qwen3-MoE model (every layer a MoE layer): the parameters a token
    meets are attention's, the router's, its top-k experts' and the output layer's
    (``active_params``; all experts': ``total_params``). LoRA on attention, on each of its
    experts' three projections (Tinker's layout: ``r·3(H + I)`` an expert a token), and on the
    output layer."""
    hidden, layers, vocab, r = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], lora_rank
    experts = c.get("num_experts") or c["num_local_experts"]  # transformers 5 writes the latter
    top_k, inner = c["num_experts_per_tok"], c["moe_intermediate_size"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    q, kv_out = heads * head_dim, kv * head_dim
    attention = hidden * (q + 2 * kv_out) + q * hidden
    expert = 3 * hidden * inner
    params = layers * (attention + hidden * experts + top_k * expert) + vocab * hidden
    total = layers * (attention + hidden * experts + experts * expert) + vocab * hidden
    lora_attention = r * (3 * hidden + q + 2 * kv_out + q + hidden)
    lora = layers * (lora_attention + top_k * r * 3 * (hidden + inner)) + r * (hidden + vocab)
    attention_fwd = 4 * layers * q * mean_context
    return _moe_flops(params, total, lora, attention_fwd)


def _moe_flops(params: float, total: float, lora: float, attention_fwd: float) -> dict[str, float]:
    """A mixture of experts' figures: ``params`` those a token meets (``active_params``), ``total``
    every expert's."""
    return {
        "matmul_params": params,
        "active_params": params,
        "total_params": total,
        "lora_params": lora,
        "model_flops_6p": 6 * params + 3 * attention_fwd,
        "lora_step_flops": 4 * params + 6 * lora + 3 * attention_fwd,
    }


def latent_flops_per_token(c: dict[str, Any], mean_context: float, lora_rank: int) -> dict[str, float]:
    """``flops_per_token`` of a DeepSeek-V3 / Kimi-K2 model: latent attention (q down and up
    projections, or one q_proj; the kv down projection to the latent and the rotary key, its up
    projection to each head's key and value; o_proj), whose scores are over ``nope + rope``
    dimensions a head and values over ``v``; the first ``first_k_dense_replace`` layers' dense
    MLP, then MoE layers of a router, the top-k experts and the shared experts. LoRA on every
    projection (Tinker's layout for the routed experts, ``r·3(H + I)`` an expert a token)."""
    hidden, layers, vocab, r = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], lora_rank
    heads, q_rank, kv_rank = c["num_attention_heads"], c.get("q_lora_rank") or 0, c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    experts = c.get("n_routed_experts") or c["num_local_experts"]  # transformers 5 may write the latter
    top_k, inner, dense = c["num_experts_per_tok"], c["moe_intermediate_size"], c["first_k_dense_replace"]
    shared = (c.get("n_shared_experts") or 0) * inner
    q_out = heads * (nope + rope)
    # (in, out) of each attention projection
    projections = [(hidden, q_rank), (q_rank, q_out)] if q_rank else [(hidden, q_out)]
    projections += [(hidden, kv_rank + rope), (kv_rank, heads * (nope + v)), (heads * v, hidden)]
    attention = sum(i * o for i, o in projections)
    dense_mlp, expert, shared_mlp = 3 * hidden * c["intermediate_size"], 3 * hidden * inner, 3 * hidden * shared
    moe_layers = layers - dense
    params = layers * attention + dense * dense_mlp + moe_layers * (hidden * experts + top_k * expert + shared_mlp)
    total = layers * attention + dense * dense_mlp + moe_layers * (hidden * experts + experts * expert + shared_mlp)
    params, total = params + vocab * hidden, total + vocab * hidden
    lora_attention = r * sum(i + o for i, o in projections)
    lora_dense = r * 3 * (hidden + c["intermediate_size"])
    lora_moe = top_k * r * 3 * (hidden + inner) + (r * 3 * (hidden + shared) if shared else 0)
    lora = layers * lora_attention + dense * lora_dense + moe_layers * lora_moe + r * (hidden + vocab)
    attention_fwd = 2 * layers * heads * (nope + rope + v) * mean_context  # scores, then values
    return _moe_flops(params, total, lora, attention_fwd)


DELTA_CHUNK = 64  # the gated delta rule's chunk (transformers' and flash-linear-attention's)


def hybrid_flops_per_token(c: dict[str, Any], mean_context: float, lora_rank: int) -> dict[str, float]:
    """``flops_per_token`` of a Qwen3.5 language model (``c``: its text config): gated full
    attention (q_proj twice as wide: queries and their gates) in the ``full_attention`` layers,
    Gated-DeltaNet in the others, whose sequence mixing costs per token and value head the
    chunked delta rule's leading terms: the state read, corrected and written (3 products of
    d_k·d_v), and within its chunk of 64 (half of it on average) the q·k and weights·v products
    and the triangular solve. LoRA in Tinker's layout (``rank.linear_attention``). A MoE one's
    layers each have a router, the top-k routed experts (of all: ``total_params``) and a shared
    expert behind its one-output gate; LoRA on each expert a token meets and the shared one."""
    hidden, vocab, r = c["hidden_size"], c["vocab_size"], lora_rank
    kinds = c["layer_types"][: c["num_hidden_layers"]]
    full, linear = kinds.count("full_attention"), kinds.count("linear_attention")
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    kd, vd = (
        c["linear_num_key_heads"] * c["linear_key_head_dim"],
        c["linear_num_value_heads"] * c["linear_value_head_dim"],
    )
    nv, dk, dv = c["linear_num_value_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
    experts = c.get("num_experts") or 0
    if experts:
        top_k, inner, shared = (
            c["num_experts_per_tok"],
            c["moe_intermediate_size"],
            c["shared_expert_intermediate_size"],
        )
        gates = hidden * experts + 3 * hidden * shared + hidden  # the router, the shared expert and its gate
        mlp, mlp_total = gates + top_k * 3 * hidden * inner, gates + experts * 3 * hidden * inner
        lora_mlp = top_k * r * 3 * (hidden + inner) + r * 3 * (hidden + shared)
    else:
        mlp = mlp_total = 3 * hidden * c["intermediate_size"]
        lora_mlp = r * 3 * (hidden + c["intermediate_size"])
    full_attention = hidden * (2 * q + 2 * kv) + q * hidden
    linear_attention = hidden * (2 * kd + 2 * vd + 2 * nv) + vd * hidden
    params = full * (full_attention + mlp) + linear * (linear_attention + mlp) + vocab * hidden
    lora_full = r * ((hidden + 2 * q) + 2 * (hidden + kv) + (q + hidden)) + lora_mlp
    lora_linear = r * (2 * (hidden + kd) + 2 * (hidden + vd) + (vd + hidden)) + lora_mlp
    lora = full * lora_full + linear * lora_linear + r * (hidden + vocab)
    half_chunk = DELTA_CHUNK / 2
    mixing_fwd = full * 4 * q * mean_context + linear * nv * (6 * dk * dv + 4 * half_chunk * (dk + dv))
    if experts:
        total = params + (full + linear) * (mlp_total - mlp)
        return _moe_flops(params, total, lora, mixing_fwd)
    return {
        "matmul_params": params,
        "lora_params": lora,
        "model_flops_6p": 6 * params + 3 * mixing_fwd,
        "lora_step_flops": 4 * params + 6 * lora + 3 * mixing_fwd,
    }


# dense bf16 peaks by device name, the first match wins: PCIe and NVL cards before SXM's 989
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H200 NVL": 835.0, "H100": 989.0, "H200": 989.0}


def peak_tflops(args: Any) -> float | None:
    """``--peak-tflops``, or on CUDA the dense bf16 peak of a GPU the table knows (MFU's denominator)."""
    if args.peak_tflops is not None or not args.device.startswith("cuda"):
        return args.peak_tflops
    import torch

    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
