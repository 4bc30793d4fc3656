"""What does data parallelism buy, and what does it cost? The same SFT steps (forward_backward +
optim_step on one batch of unequal sequences) on every training path the server has, in one run,
alternating rounds:

    in_process   the PEFT backend called in this process (the baseline: no worker, no pipe)
    peft         the peft backend in its worker process (what `serve --backend peft` runs)
    ddp1         the ddp backend with one rank (its own overhead: target within 5% of peft)
    ddpN         the ddp backend with N ranks (throughput scaling over ddp1)

    python benchmarks/ddp_scaling.py [--ranks 2 --batch 16 --seq-len 256 --model DIR]
    python benchmarks/ddp_scaling.py --device cuda --ranks 2 --model DIR   # cuda:0 and cuda:0,1

On the CPU, N ranks share the machine's cores (each rank gets cores/N threads), so ddpN measures
how well the work splits, not extra hardware. Every path trains the same adapter on the same
batch, so their losses must agree (checked to a relative 1e-4: ranks sum in another order).
Prints a table and writes benchmarks/results/ddp_scaling-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import add_common_args, model_label, print_table, result_header, setup, write_results  # noqa: E402
from hosted_tinker.core.config import ServerConfig  # noqa: E402
from hosted_tinker.core.types import AdamParams, DatumInput, ForwardBackwardBatch, LoraSpec  # noqa: E402
from hosted_tinker.rank.serve import local_rank  # noqa: E402
from hosted_tinker.rank.trainer import Trainer  # noqa: E402
from hosted_tinker.server.workers.backend import ProcessBackend  # noqa: E402
from hosted_tinker.server.workers.launch import rank_factories  # noqa: E402

LORA = LoraSpec(rank=32, seed=0)


def make_batch(batch: int, seq_len: int, vocab: int, seed: int = 0, min_len: int | None = None) -> ForwardBackwardBatch:
    """``batch`` sequences of ``min_len`` (seq_len/2 unless given) .. seq_len tokens: unequal, so
    shards balance by tokens."""
    rng = np.random.default_rng(seed)
    data = []
    for n in rng.integers(seq_len // 2 if min_len is None else min_len, seq_len + 1, batch):
        seq = torch.from_numpy(rng.integers(10, vocab - 1, int(n) + 1))
        data.append(DatumInput(tokens=seq[:-1], target_tokens=seq[1:], inputs={"weights": torch.ones(int(n))}))
    return ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)


def model_shape(model: str) -> str:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    return f"{c.model_type}, hidden {c.hidden_size}, {c.num_hidden_layers} layers, vocab {c.vocab_size}"


def devices_for(device: str, ranks: int) -> str:
    """The ``--train-devices`` of ``ranks`` ranks on ``device``'s kind."""
    if device.startswith("cuda"):
        return "cuda:" + ",".join(str(i) for i in range(ranks))
    return f"cpu:{ranks}"


def worker_backend(
    model: str, backend: str, train_devices: str, options: dict[str, str] | None = None, dtype: str = "float32"
) -> ProcessBackend:
    config = ServerConfig(
        model=model, backend=backend, train_devices=train_devices, backend_options=options or {}, dtype=dtype
    )
    return ProcessBackend(rank_factories(config, model))


def step(backend: Trainer, batch: ForwardBackwardBatch, adam: AdamParams) -> tuple[float, float]:
    """One SFT step; its seconds and loss."""
    start = time.perf_counter()
    loss = backend.forward_backward("bench", batch).loss_sum
    backend.optim_step("bench", adam)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the in-process path's kernels; the workers' answers already waited
    return time.perf_counter() - start, loss


def run_rounds(
    paths: dict[str, Trainer], batch: ForwardBackwardBatch, adam: AdamParams, rounds: int, steps: int
) -> dict[str, dict[str, list[float]]]:
    """Alternate blocks of steps so that drifting machine load hits every path alike."""
    out = {name: {"seconds": [], "loss": []} for name in paths}
    for _ in range(rounds):
        for name, backend in paths.items():
            for _ in range(steps):
                seconds, loss = step(backend, batch, adam)
                out[name]["seconds"].append(seconds)
                out[name]["loss"].append(loss)
    return out


def measure(
    makers: dict[str, Callable[[], Trainer | ProcessBackend]], batch: ForwardBackwardBatch, adam: AdamParams, args: Any
) -> dict[str, dict[str, list[float]]]:
    """Start the paths and create the adapter on each, warm them up (``args.warmup`` steps at
    learning rate 0: first steps allocate), time ``args.rounds`` x ``args.steps`` in alternating
    rounds (``run_rounds``), and stop the worker processes."""
    paths: dict[str, Trainer] = {}  # in this process, or the workers' (``ProcessBackend.trainer``)
    workers: list[ProcessBackend] = []
    try:
        for name, make in makers.items():
            made = make()
            if isinstance(made, ProcessBackend):
                workers.append(made)
            paths[name] = made.trainer if isinstance(made, ProcessBackend) else made
            paths[name].create_adapter("bench", LORA)
        for backend in paths.values():
            for _ in range(args.warmup):
                step(backend, batch, AdamParams(learning_rate=0.0))
        return run_rounds(paths, batch, adam, args.rounds, args.steps)
    finally:
        for worker in workers:
            worker.close()


def workload(args: Any, tokens: int, model: str) -> dict[str, Any]:
    """The ``workload`` fields both training benchmarks write (each adds its layout)."""
    return {
        "batch": args.batch,
        "tokens_per_step": tokens,
        "seq_len": f"{args.min_len or args.seq_len // 2}..{args.seq_len}",
        "steps_measured": args.steps * args.rounds,
        "rounds": args.rounds,
        "lora_rank": LORA.rank,
        "model": model_label(args.model),
        "model_shape": model_shape(model),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="N of the ddpN path")
    parser.add_argument("--steps", type=int, default=5, help="steps per round and path")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=None, help="the shortest sequence (default: seq-len / 2)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["in_process", "ddpN"],
        help="leave a path out (e.g. ddpN on a single GPU, or in_process to keep one model copy less on it)",
    )
    add_common_args(parser)
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error("--ranks must be at least 2 (ddp1 is always measured; --skip ddpN leaves ddpN out)")

    _, model, vocab = setup(args.model)
    batch = make_batch(args.batch, args.seq_len, vocab, min_len=args.min_len)
    tokens = sum(d.num_tokens for d in batch.data)
    adam = AdamParams(learning_rate=args.lr)
    one = "cuda:0" if args.device.startswith("cuda") else "cpu"

    ddp_n = f"ddp{args.ranks}"
    makers: dict[str, Callable[[], Trainer | ProcessBackend]] = {
        "in_process": lambda: local_rank(model, device=one).trainer,
        "peft": lambda: worker_backend(model, "peft", one),
        "ddp1": lambda: worker_backend(model, "ddp", devices_for(args.device, 1)),
        ddp_n: lambda: worker_backend(model, "ddp", devices_for(args.device, args.ranks)),
    }
    for skipped in args.skip:
        del makers[ddp_n if skipped == "ddpN" else skipped]
    timings = measure(makers, batch, adam, args)
    paths = list(timings)

    median_s = {name: statistics.median(t["seconds"]) for name, t in timings.items()}
    losses = np.array([timings[name]["loss"] for name in paths])
    same_math = bool(np.allclose(losses, losses[0], rtol=1e-4))
    results = {
        **result_header("ddp_scaling", args.device),
        "workload": {**workload(args, tokens, model), "ranks": args.ranks},
        "step_ms_median": {name: 1000 * s for name, s in median_s.items()},
        "step_ms_p10_p90": {
            name: [1000 * float(np.percentile(t["seconds"], q)) for q in (10, 90)] for name, t in timings.items()
        },
        "tokens_per_s": {name: tokens / s for name, s in median_s.items()},
        "ratio_ddp1_over_peft_step_time": median_s["ddp1"] / median_s["peft"],
        "losses_equal_on_every_path_rtol_1e-4": same_math,
        "targets": {"ratio_ddp1_over_peft": 1.05},
    }
    rows = [(f"{name}: step", f"{1000 * s:8.1f} ms   {tokens / s:8.0f} tok/s") for name, s in median_s.items()]
    rows.append(("ddp1 / peft step time (target ≤ 1.05)", f"{results['ratio_ddp1_over_peft_step_time']:8.3f}"))
    if "in_process" in median_s:
        results["ratio_peft_worker_over_in_process_step_time"] = median_s["peft"] / median_s["in_process"]
        rows.append(("peft worker / in-process step time", f"{median_s['peft'] / median_s['in_process']:8.3f}"))
    if ddp_n in median_s:
        results[f"speedup_{ddp_n}_over_ddp1"] = median_s["ddp1"] / median_s[ddp_n]
        rows.append((f"{ddp_n} speed-up over ddp1", f"{median_s['ddp1'] / median_s[ddp_n]:8.3f}"))
    rows.append(("losses equal on every path (rtol 1e-4)", f"{same_math!s:>8}"))
    print_table(
        f"ddp scaling on {results['device']}: {args.batch} sequences, {tokens} tokens a step, "
        f"{args.rounds} x {args.steps} steps per path",
        rows,
    )
    write_results(results, args.out, args.device)


if __name__ == "__main__":
    main()
