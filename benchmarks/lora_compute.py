"""LoRA's products in float32 against the base's dtype (``--lora-compute``): one trainer in
this process, one batch, the two in alternating rounds after a warm-up:

    float32   PEFT's arithmetic over float32 adapters (the default): each LoRA layer casts its
              input to float32, multiplies there (off a GPU's tensor cores) and casts the sum back
    base      the products and the sum in the base's dtype, as PEFT under torch.autocast

    python benchmarks/lora_compute.py --dtype bfloat16          # CPU: Qwen3 shape h512 x 4 layers
    python benchmarks/lora_compute.py --device cuda --shape qwen3-8b --dtype bfloat16 \\
        --seqs 1 --seq-len 4096                                 # what gpu_checks.sh runs

It prints each one's step time, tokens/s and MFU (6·P + attention) and the two losses' relative
difference (the adapter's B moved off zero first, so that its products count; on a float32 base
the two are the same arithmetic). Writes benchmarks/results/lora_compute-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import add_common_args, print_table, result_header, write_results  # noqa: E402
from benchmarks.shapes import SHAPES, flops_per_token, peak_tflops, random_model, vocab_size  # noqa: E402
from benchmarks.train_efficiency import (  # noqa: E402
    LORA_RANK,
    efficiency,
    lora_spec,
    make_batch,
    mean_context,
    timed,
    trainer_on,
)

COMPUTES = ("float32", "base")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-h512-l4")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--seqs", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak (default on H100/H200)")
    add_common_args(parser)
    args = parser.parse_args()

    import torch

    model = random_model(args.shape, args.dtype)
    lengths = [args.seq_len] * args.seqs
    tokens = sum(lengths)
    batch = make_batch(lengths, vocab_size(model))
    trainer = trainer_on(model, args.device, args.dtype)
    trainer.create_adapter("m", lora_spec())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B starts at zero, where the update is zero whatever computes it
        for p in trainer.adapters["m"].handle.params:
            p.add_((torch.randn(p.shape, generator=generator) * 0.01).to(p.device))
    adapters = trainer.model.adapters  # rank.adapters.LoraAdapters: what --lora-compute sets

    seconds: dict[str, list[float]] = {name: [] for name in COMPUTES}
    losses: dict[str, float] = {}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name in COMPUTES:
            adapters.compute = name
            t, result = timed(lambda: trainer.forward_backward("m", batch), args.device)
            losses[name] = result.loss_sum
            for p in trainer.adapters["m"].handle.params:
                p.grad = None
            if round_:
                seconds[name].append(t)

    flops = flops_per_token(model, mean_context(lengths), LORA_RANK)
    peak = peak_tflops(args)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    results: dict[str, Any] = {
        **result_header("lora_compute", args.device),
        "workload": {"model": args.shape, "dtype": args.dtype, "lengths": lengths, "lora_rank": LORA_RANK},
        "flops_per_token": flops,
        "step_s_median": median,
        "paths": {name: efficiency(flops, tokens, s, peak) for name, s in median.items()},
        "speedup_base_over_float32": median["float32"] / median["base"],
        "loss_sum": losses,
        "loss_sum_rel_diff": abs(losses["base"] - losses["float32"]) / abs(losses["float32"]),
    }
    rows = []
    for name in COMPUTES:
        e = results["paths"][name]
        mfu = f"   MFU {100 * e['mfu_6p']:.1f} %" if "mfu_6p" in e else ""
        rows.append((f"lora compute {name}", f"{1000 * median[name]:9.1f} ms  {e['tokens_per_s']:8.0f} tok/s{mfu}"))
    rows.append(("base over float32", f"{results['speedup_base_over_float32']:.2f}x"))
    rows.append(("losses' relative difference", f"{results['loss_sum_rel_diff']:.1e}"))
    print_table(f"LoRA compute on {results['device']}: {args.seqs} x {args.seq_len} tokens, {args.shape}", rows)
    write_results(results, args.out, args.device)


if __name__ == "__main__":
    main()
