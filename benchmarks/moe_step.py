"""The training step of a mixture-of-experts model with a LoRA on every routed expert
(``rank.experts``), against the same step without expert LoRA (attention and unembedding only),
alternating in one run, one trainer in this process (no HTTP).

The model is Qwen3-30B-A3B's shape with random weights (128 experts, 8 per token, hidden 2048,
expert width 768, Qwen3's vocabulary), cut to ``--layers`` decoder layers (2 by default: on a
CPU a full-depth step takes minutes). It prints the FLOPs of a token over the parameters a token
meets (the active ones: its 8 experts, not all 128) and, given the device's peak
(``--peak-tflops``; H100/H200 bf16 by default on CUDA), the MFU of each path.

    python benchmarks/moe_step.py                                   # CPU, 2 layers, 512 tokens
    python benchmarks/moe_step.py --device cuda --dtype bfloat16 --layers 48 --tokens 8192

Writes benchmarks/results/moe_step-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import add_common_args, print_table, result_header, write_results  # noqa: E402
from benchmarks.shapes import SHAPES, flops_per_token, peak_tflops, random_model  # noqa: E402
from benchmarks.train_efficiency import efficiency, make_batch, timed, trainer_on  # noqa: E402

LORA_RANK = 32
SHAPE = "qwen3-30b-a3b"  # benchmarks.shapes: cut to --layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak (default on H100/H200)")
    add_common_args(parser)
    args = parser.parse_args()

    from hosted_tinker.core.types import LoraSpec

    model = random_model(SHAPE, args.dtype, layers=args.layers)
    trainer = trainer_on(model, args.device, args.dtype)
    trainer.create_adapter("experts", LoraSpec(rank=LORA_RANK, seed=1))
    trainer.create_adapter("attention", LoraSpec(rank=LORA_RANK, seed=1, train_mlp=False))
    batch = make_batch([args.tokens], SHAPES[SHAPE]["vocab_size"])
    seconds: dict[str, list[float]] = {"experts": [], "attention": []}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name in seconds:
            t, _ = timed(lambda name=name: trainer.forward_backward(name, batch), args.device)
            if round_:
                seconds[name].append(t)
            print(f"  round {round_} {name}: {t:.2f} s", flush=True)
    flops = flops_per_token(model, args.tokens / 2, LORA_RANK)
    peak = peak_tflops(args)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    results = {
        **result_header("moe_step", args.device),
        "model": f"Qwen3-30B-A3B shape, {args.layers} layers, random weights ({args.dtype})",
        "lora_rank": LORA_RANK,
        "tokens": args.tokens,
        "flops_per_token": flops,
        "peak_tflops": peak,
        "step_s_median": median,
        "paths": {name: efficiency(flops, args.tokens, s, peak) for name, s in median.items()},
        "step_ratio_expert_lora_over_attention_only": median["experts"] / median["attention"],
    }
    rows = [
        ("active params / token", f"{flops['active_params'] / 1e6:,.0f} M"),
        ("model FLOPs / token (6P + attention)", f"{flops['model_flops_6p'] / 1e9:.2f} GFLOP"),
    ]
    for name, e in results["paths"].items():
        mfu = f"   MFU {100 * e['mfu_6p']:.1f} %" if "mfu_6p" in e else ""
        rows.append((f"step, LoRA on {name}", f"{median[name]:.2f} s  {e['tokens_per_s']:.0f} tok/s{mfu}"))
    rows.append(("expert LoRA / attention-only step", f"{results['step_ratio_expert_lora_over_attention_only']:.2f}x"))
    print_table(f"MoE training step on {results['device']}", rows)
    write_results(results, args.out, args.device)


if __name__ == "__main__":
    main()
