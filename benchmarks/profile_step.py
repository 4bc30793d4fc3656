"""Where does a training step's time go? One ``forward_backward`` of the trainer in this process
(the step as a rank runs it, no HTTP) under PyTorch's profiler, after a warm-up step:

    python benchmarks/profile_step.py                                   # tiny model, CPU
    python benchmarks/profile_step.py --device cuda --shape qwen3-8b --dtype bfloat16 \\
        --batch 1 --seq-len 4096                                        # what gpu_checks.sh runs

It prints the step's wall time, the time the device was busy (on CUDA: the kernels' own time
summed; what is left is the GPU waiting on the host), that busy time by kind of work (matrix
products, attention, casts and copies, elementwise work and reductions, collectives) and the
operators or kernels that took the most of it. Kernels are sorted into kinds by name
(``KINDS``): a name no pattern knows counts as "other", so the table shows how much went
unsorted. Writes benchmarks/results/profile_step-<device>.json.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import add_common_args, print_table, result_header, setup, write_results  # noqa: E402
from benchmarks.shapes import SHAPES, flops_per_token, peak_tflops, random_model, vocab_size  # noqa: E402
from benchmarks.train_efficiency import LORA_RANK, lora_spec, make_batch, mean_context, sync, trainer_on  # noqa: E402

# Kinds of device work by kernel (or, on the CPU, operator) name; the first match wins.
KINDS: list[tuple[str, re.Pattern[str]]] = [
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|matmul|cutlass|xmma|nvjet|cublas|aten::mm$|aten::bmm$|aten::addmm$|linear", re.I)),
    ("cast/copy", re.compile(r"copy|cast|to_copy|memcpy|memset|cat|contiguous|clone|fill|index", re.I)),
    (
        "elementwise",
        re.compile(r"elementwise|reduce|norm|rsqrt|silu|sigmoid|softmax|mul|add|sub|exp|log|div|pow|sum|mean", re.I),
    ),
    ("collective", re.compile(r"nccl|gloo|allreduce|all_reduce|reduce_scatter|all_gather", re.I)),
]


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def device_events(profile: Any, on_cuda: bool) -> list[tuple[str, float, int]]:
    """``(name, self time in µs, calls)`` per name: CUDA kernels on a GPU, operators on the CPU
    (where an operator's self time is the work its kernel did)."""
    from torch.autograd import DeviceType

    rows = []
    for e in profile.key_averages():
        if on_cuda:
            if e.device_type != DeviceType.CUDA:
                continue
            self_us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        else:
            self_us = e.self_cpu_time_total
        if self_us > 0:
            rows.append((e.key, float(self_us), int(e.count)))
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random weights of this shape")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--top", type=int, default=25, help="rows of the busiest operators or kernels")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak (default on H100/H200)")
    add_common_args(parser)
    args = parser.parse_args()

    from torch.profiler import ProfilerActivity, profile

    model = random_model(args.shape, args.dtype) if args.shape else setup(args.model)[1]
    trainer = trainer_on(model, args.device, args.dtype)
    trainer.create_adapter("m", lora_spec())
    lengths = [args.seq_len] * args.batch
    batch = make_batch(lengths, vocab_size(model))
    trainer.forward_backward("m", batch)  # warm-up: kernels chosen, allocator's pools filled
    sync(args.device)

    on_cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        trainer.forward_backward("m", batch)
        sync(args.device)
        wall_us = (time.perf_counter() - start) * 1e6
    events = device_events(prof, on_cuda)
    busy_us = sum(us for _, us, _ in events)
    by_kind: dict[str, float] = {}
    for name, us, _ in events:
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + us

    tokens = sum(lengths)
    flops = flops_per_token(model, mean_context(lengths), LORA_RANK)
    peak = peak_tflops(args)
    results: dict[str, Any] = {
        **result_header("profile_step", args.device),
        "workload": {"model": args.shape or model, "dtype": args.dtype, "lengths": lengths, "lora_rank": LORA_RANK},
        "wall_ms": wall_us / 1e3,
        "device_busy_ms": busy_us / 1e3,
        "busy_fraction": busy_us / wall_us,
        "busy_ms_by_kind": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top": [{"name": n[:300], "self_ms": us / 1e3, "calls": c} for n, us, c in events[: args.top]],
        "flops_per_token": flops,
        "peak_tflops": peak,
        "note": "the profiler's own overhead is in wall_ms: compare it with an unprofiled step's time",
    }
    if peak:
        results["mfu_6p"] = flops["model_flops_6p"] * tokens / (wall_us / 1e6) / (peak * 1e12)
    rows = [
        ("step (profiled)", f"{wall_us / 1e3:10.1f} ms"),
        ("device busy", f"{busy_us / 1e3:10.1f} ms  ({100 * busy_us / wall_us:.0f} % of the step)"),
    ]
    rows += [
        (f"  {kind}", f"{ms:10.1f} ms  ({100 * ms * 1e3 / busy_us:.0f} %)")
        for kind, ms in results["busy_ms_by_kind"].items()
    ]
    if "mfu_6p" in results:
        rows.append(("MFU (6P + attention)", f"{100 * results['mfu_6p']:.1f} %"))
    print_table(f"one step on {results['device']}: {len(lengths)} x {args.seq_len} tokens", rows)
    width = 90
    print_table(
        f"busiest {'kernels' if on_cuda else 'operators'} (self time)",
        [(f"{n[:width]}", f"{us / 1e3:9.2f} ms  x{c}") for n, us, c in events[: args.top]],
        width=width,
    )
    write_results(results, args.out, args.device)


if __name__ == "__main__":
    main()
