"""Recomputing every decoder layer against recomputing as few as a memory budget needs
(``--backend-option activation_memory_gib``): one trainer in this process, one batch, the two
rules in alternating rounds after a warm-up:

    recompute_all   every layer runs again in the backward pass (what a micro-batch over
                    ``recompute_above_tokens`` does by default)
    budget          as many of the last layers as fit the budget keep their activations

    python benchmarks/activation_memory.py                 # CPU: a budget that stores about half
    python benchmarks/activation_memory.py --device cuda --shape qwen3-8b --dtype bfloat16 \\
        --seqs 4 --seq-len 4096                            # GPU: the budget is auto (free memory)

It prints each rule's step time, tokens/s and MFU (6·P + attention), the layers the budget
recomputed, what a stored layer keeps per token (measured), and on CUDA each rule's peak memory.
Writes benchmarks/results/activation_memory-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-h512-l4")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seqs", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--budget-gib", type=float, default=None, help="default: auto on CUDA, half of all on a CPU")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak (default on H100/H200)")
    add_common_args(parser)
    args = parser.parse_args()

    import torch

    on_cuda = args.device.startswith("cuda")
    model = random_model(args.shape, args.dtype)
    lengths = [args.seq_len] * args.seqs
    tokens = sum(lengths)
    batch = make_batch(lengths, vocab_size(model))
    trainer = trainer_on(model, args.device, args.dtype, microbatch_tokens=max(tokens, 16384))
    trainer.create_adapter("m", lora_spec())
    layers = len(trainer.model.layers)

    trainer.activation_memory = float("inf")  # the warm-up pass measures what a stored layer keeps
    timed(lambda: trainer.forward_backward("m", batch), args.device)
    per_layer = trainer.layer_bytes_per_token * tokens
    if args.budget_gib is not None:
        budget: float | str = args.budget_gib * 2**30
    elif on_cuda:
        budget = "auto"
    else:
        budget = per_layer * (layers // 2 + 1.5)  # half the layers stored, room for one more

    rules = {"recompute_all": (None, 0), "budget": (budget, 8192)}
    seconds: dict[str, list[float]] = {name: [] for name in rules}
    peaks: dict[str, int] = {}
    losses: dict[str, float] = {}
    recomputed: dict[str, int] = {}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name, (memory, above) in rules.items():
            trainer.activation_memory, trainer.recompute_above_tokens = memory, above
            recomputed[name] = trainer.layers_to_recompute(tokens)
            if on_cuda:
                torch.cuda.reset_peak_memory_stats()
            t, result = timed(lambda: trainer.forward_backward("m", batch), args.device)
            losses[name] = result.loss_sum
            for p in trainer.adapters["m"].handle.params:
                p.grad = None
            if on_cuda:
                peaks[name] = torch.cuda.max_memory_allocated()
            if round_:
                seconds[name].append(t)

    flops = flops_per_token(model, mean_context(lengths), LORA_RANK)
    peak = peak_tflops(args)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    results: dict[str, Any] = {
        **result_header("activation_memory", args.device),
        "workload": {"model": args.shape, "dtype": args.dtype, "lengths": lengths, "lora_rank": LORA_RANK},
        "layers": layers,
        "stored_layer_bytes_per_token": trainer.layer_bytes_per_token,
        "budget": budget,
        "layers_recomputed": recomputed,
        "step_s_median": median,
        "paths": {name: efficiency(flops, tokens, s, peak) for name, s in median.items()},
        "peak_allocated_bytes": peaks or None,
        "speedup_budget_over_recompute_all": median["recompute_all"] / median["budget"],
        "loss_sum": losses,
        "losses_equal_rtol_1e-5": bool(np.isclose(losses["budget"], losses["recompute_all"], rtol=1e-5)),
    }
    rows = []
    for name in rules:
        e = results["paths"][name]
        mfu = f"   MFU {100 * e['mfu_6p']:.1f} %" if "mfu_6p" in e else ""
        memory = f"   peak {peaks[name] / 2**30:.1f} GiB" if peaks else ""
        label = f"{name} ({recomputed[name]} of {layers} layers recomputed)"
        rows.append((label, f"{1000 * median[name]:9.1f} ms  {e['tokens_per_s']:8.0f} tok/s{mfu}{memory}"))
    rows.append(("a stored layer keeps, per token", f"{trainer.layer_bytes_per_token:,.0f} bytes"))
    rows.append(("budget over recompute_all", f"{results['speedup_budget_over_recompute_all']:.2f}x"))
    rows.append(("losses equal (rtol 1e-5)", str(results["losses_equal_rtol_1e-5"])))
    print_table(f"activation memory on {results['device']}: {args.seqs} x {args.seq_len} tokens, {args.shape}", rows)
    write_results(results, args.out, args.device)


if __name__ == "__main__":
    main()
