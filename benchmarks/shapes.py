"""Model shapes the benchmarks run with random weights, and the FLOPs a trained token costs.

FLOPs per token of a decoder with LoRA on attention and MLP (P: the matmul weights a token meets,
the output layer included; embedding lookups are free):

    model FLOPs   6·P + 3·attention_fwd      the usual convention for MFU
    LoRA step     4·P + 6·P_lora + 3·attention_fwd
                  what a LoRA step executes: the frozen base has no weight gradients (forward
                  2·P, input gradients 2·P), the adapters have all three

with attention_fwd = 4 · layers · (heads · head_dim) · context: scores and values over a causal
context of ``context`` positions on average (N/2 for one sequence of N, Σ N²/2 / Σ N for many).
Recomputed activations are not counted: MFU is of the model's FLOPs, not of the work done.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
}


MODEL_CACHE = Path.home() / ".cache" / "hosted-tinker" / "bench-models"


def random_model(shape: str, dtype: str, root: Path = MODEL_CACHE) -> str:
    """A model folder of ``SHAPES[shape]`` with random weights in ``dtype`` (and the tiny
    tokenizer: the benchmark feeds token ids), written once and reused."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return write_random_model(
        Qwen3ForCausalLM, Qwen3Config(**SHAPES[shape], dtype=dtype), root / f"{shape}-random-{dtype}"
    )


def write_random_model(model_class: type, config: Any, out: Path) -> str:
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


# dense bf16 peaks by device name, the first match wins: PCIe and NVL cards before SXM's 989
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H200 NVL": 835.0, "H100": 989.0, "H200": 989.0}


def peak_tflops(args: Any) -> float | None:
    """``--peak-tflops``, or on CUDA the dense bf16 peak of a GPU the table knows (MFU's denominator)."""
    if args.peak_tflops is not None or not args.device.startswith("cuda"):
        return args.peak_tflops
    import torch

    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
