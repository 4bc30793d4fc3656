"""What does tensor parallelism cost, and what does it buy? The same SFT steps (forward_backward
+ optim_step on one batch of unequal sequences) on the peft backend and on megatron at tp=1 and
tp=N, in one run, alternating rounds:

    peft         the peft backend in its worker process (the baseline)
    tp1          megatron-core with one rank (its own overhead over peft)
    tpN          megatron-core with N tensor-parallel ranks
    epE          (``--ep E``, a mixture-of-experts model, in place of tpN) its routed experts
                 split over E ranks, each running its own shard of the batch

    python benchmarks/megatron_tp.py [--tp 2 --batch 8 --seq-len 256 --model DIR]
    python benchmarks/megatron_tp.py --device cuda --tp 2 --model DIR --peak-tflops 989
    # issue #16's GPU figure: Qwen3-8B's shape with random weights, a 4K-token sequence, one
    # path at a time (two 8B copies and their activations do not share one 80 GB GPU)
    python benchmarks/megatron_tp.py --device cuda --shape qwen3-8b --dtype bfloat16 --tp 1 \
        --batch 1 --seq-len 4096 --min-len 4096 --one-at-a-time
    # issue #42: Qwen3-30B-A3B's experts (its first two layers, whole width) over two ranks
    python benchmarks/megatron_tp.py --shape qwen3-30b-a3b-l2 --ep 2 --batch 4 --seq-len 256

Every path trains the same adapter (LoRA draws the same initial weights everywhere) on the same
batch, so their losses must agree (checked to a relative 1e-4 in float32, 2e-2 in bfloat16).
It prints the model FLOPs of a token and of a step, so that MFU follows from any step time on
any device (``--peak-tflops``, or a known H100's or H200's own, prints it): ``6·P + attention``
(the usual convention; P the matmul weights a token meets) and what a LoRA step executes (the
frozen base has no weight gradients: ``4·P``, plus the adapters' ``6·P_lora``).
Writes benchmarks/results/megatron_tp-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.ddp_scaling import LORA, devices_for, make_batch, measure, worker_backend, workload  # noqa: E402
from benchmarks.report import (  # noqa: E402
    add_common_args,
    print_table,
    record_failure,
    result_header,
    setup,
    write_results,
)
from benchmarks.shapes import SHAPES, flops_per_token, peak_tflops, random_model  # noqa: E402
from hosted_tinker.core.types import AdamParams  # noqa: E402
from hosted_tinker.server.workers.backend import ProcessBackend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="N of the tpN path")
    parser.add_argument(
        "--ep", type=int, default=None, help="E of an epE path in place of tpN (a mixture-of-experts model)"
    )
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="the tpN path split by sequence between its layers"
    )
    parser.add_argument("--steps", type=int, default=4, help="steps per round and path")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=None, help="the shortest sequence (default: seq-len / 2)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="the device's peak, for MFU (known H100s and H200s: their own)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the base model's")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random weights of this shape")
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="start, measure and stop one path after the other (for models of which the device holds one copy)",
    )
    add_common_args(parser)
    args = parser.parse_args()

    if args.shape is not None:
        args.model = random_model(args.shape, args.dtype)
    _, model, vocab = setup(args.model)
    batch = make_batch(args.batch, args.seq_len, vocab, min_len=args.min_len)
    tokens = sum(d.num_tokens for d in batch.data)
    mean_context = float(np.mean([(d.num_tokens + 1) / 2 for d in batch.data]))
    flops = flops_per_token(model, mean_context, LORA.rank)
    adam = AdamParams(learning_rate=args.lr)
    one = "cuda:0" if args.device.startswith("cuda") else "cpu"
    # the parallel path: N tensor-parallel ranks, or E expert-parallel ones
    kind, size = ("ep", args.ep) if args.ep else ("tp", args.tp)
    tp_n = f"{kind}{size}" + ("-sp" if args.sequence_parallel else "")
    parallel = {kind: str(size)} | ({"sequence_parallel": "true"} if args.sequence_parallel else {})
    no_sampler = {"embedded_sampler": "false"}  # not measured; it would hold a second copy of the base
    makers: dict[str, Callable[[], ProcessBackend]] = {  # with --tp 1, tpN is tp1
        "peft": lambda: worker_backend(model, "peft", one, dtype=args.dtype),
        "tp1": lambda: worker_backend(model, "megatron", one, {"tp": "1", **no_sampler}, args.dtype),
        tp_n: lambda: worker_backend(
            model, "megatron", devices_for(args.device, size), {**parallel, **no_sampler}, args.dtype
        ),
    }
    failed: dict[str, str] = {}
    if args.one_at_a_time:  # a path that fails (out of memory, say) is recorded; the others still run
        timings = {}
        for name, make in makers.items():
            try:
                timings |= measure({name: make}, batch, adam, args)
            except Exception as e:  # noqa: BLE001 - reported in the results, not raised
                record_failure(failed, name, e)
        if not timings:
            raise SystemExit(f"every path failed: {failed}")
    else:
        timings = measure(makers, batch, adam, args)
    paths = list(timings)

    median_s = {name: statistics.median(t["seconds"]) for name, t in timings.items()}
    losses = np.array([timings[name]["loss"] for name in paths])
    # bf16 paths sum in other orders (megatron's fused layers against HF's): equal to bf16's rounding
    rtol = 1e-4 if args.dtype == "float32" else 2e-2
    same_math = bool(np.allclose(losses, losses[0], rtol=rtol))
    step_flops = {k: v * tokens for k, v in flops.items() if k.endswith("flops") or k.endswith("_6p")}
    results = {
        **result_header("megatron_tp", args.device),
        "workload": {**workload(args, tokens, model), kind: size, "sequence_parallel": args.sequence_parallel},
        "flops_per_token": flops,
        "flops_per_step": step_flops,
        "step_ms_median": {name: 1000 * s for name, s in median_s.items()},
        "step_ms_p10_p90": {
            name: [1000 * float(np.percentile(t["seconds"], q)) for q in (10, 90)] for name, t in timings.items()
        },
        "tokens_per_s": {name: tokens / s for name, s in median_s.items()},
        "one_path_at_a_time": args.one_at_a_time,
        "dtype": args.dtype,
        "losses": {name: [float(x) for x in timings[name]["loss"]] for name in paths},
        "losses_rtol": rtol,
        "losses_equal_on_every_path": same_math,
        "failed": failed,
    }
    rows = [(f"{name}: step", f"{1000 * s:8.1f} ms   {tokens / s:8.0f} tok/s") for name, s in median_s.items()]
    rows += [(f"{name}: FAILED", reason[:60]) for name, reason in failed.items()]
    if {"tp1", "peft"} <= median_s.keys():
        results["ratio_tp1_over_peft_step_time"] = median_s["tp1"] / median_s["peft"]
        rows += [("tp1 / peft step time", f"{results['ratio_tp1_over_peft_step_time']:8.3f}")]
    if size > 1 and {"tp1", tp_n} <= median_s.keys():
        results[f"speedup_{tp_n}_over_tp1"] = median_s["tp1"] / median_s[tp_n]
        rows += [(f"{tp_n} speed-up over tp1", f"{results[f'speedup_{tp_n}_over_tp1']:8.3f}")]
    if "active_params" in flops:
        rows += [
            ("active / total parameters", f"{flops['active_params']:10.3e} / {flops['total_params']:.3e}"),
        ]
    rows += [
        ("model FLOPs / token (6P + attn)", f"{flops['model_flops_6p']:10.3e}"),
        ("LoRA step FLOPs / token (4P + 6P_lora + attn)", f"{flops['lora_step_flops']:10.3e}"),
        ("model FLOPs / step (6P + attn)", f"{step_flops['model_flops_6p']:10.3e}"),
        (f"losses equal on every path (rtol {rtol:g})", f"{same_math!s:>8}"),
    ]
    peak = peak_tflops(args)
    if peak:
        results["peak_tflops"] = peak
        mfu = {name: step_flops["model_flops_6p"] / s / (peak * 1e12) for name, s in median_s.items()}
        results["mfu_6p"] = mfu
        rows += [(f"{name}: MFU (6P + attn)", f"{100 * m:8.2f} %") for name, m in mfu.items()]
    print_table(
        f"megatron {kind} on {results['device']}: {args.batch} sequences, {tokens} tokens a step, "
        f"{args.rounds} x {args.steps} steps per path",
        rows,
    )
    write_results(results, args.out, args.device)


if __name__ == "__main__":
    main()
