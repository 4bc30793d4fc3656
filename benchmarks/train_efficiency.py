"""Efficiency per token of the training step, with MFU on any device. One trainer in this
process (the step as a rank runs it, no HTTP), four scenarios, each against its baseline in
the same run:

    mixed     16 sequences of skewed lengths (64–4096 tokens, log-uniform): packed micro-batches
              (today's path) against the padded path they replaced (``tests.support.batches.padded_path``)
    tenants   8 models × 1 datum of 256 tokens: one pass over the base for all eight
              (``Trainer.forward_backward_many``) against eight passes, one model at a time;
              and its ceiling, the same tokens as one model's batch (one adapter, one pass)
    adapters  adding the 1st, 16th and 64th model's adapter to a 0.5B-shaped rank: ours against
              PEFT's ``add_adapter`` on the same base
    long      one sequence of 8K, 16K and 32K tokens on a Qwen3-shaped model (hidden 1024,
              4 layers, Qwen3's 151,936-token vocabulary): peak memory with each decoder layer's
              activations recomputed and without, each point in a fresh process; the slope of a
              line through the points is the activation memory per token

    python benchmarks/train_efficiency.py                       # every scenario, CPU
    python benchmarks/train_efficiency.py --scenario long --lengths 2048,4096,8192
    python benchmarks/train_efficiency.py --device cuda --dtype bfloat16 --tenants-shape qwen3-8b \\
        --mixed-shape qwen3-8b --microbatch-tokens 4096         # on a GPU (scripts/gpu_checks.sh)

It prints the FLOPs of a token (``benchmarks.shapes``: 6·P + attention, and what a LoRA step
executes) and, given the device's peak (``--peak-tflops``; H100/H200 bf16 by default on CUDA),
the MFU of each path. Writes benchmarks/results/train_efficiency-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import add_common_args, print_table, record_failure, result_header, write_results  # noqa: E402
from benchmarks.shapes import flops_per_token, peak_tflops, random_model, vocab_size  # noqa: E402
from hosted_tinker.rank import memory  # noqa: E402

LORA_RANK = 32


def lengths_skewed(count: int, low: int, high: int, seed: int) -> list[int]:
    """``count`` lengths, log-uniform in [low, high]: mostly short, a few long."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.exp(rng.uniform(np.log(low), np.log(high), count)).round()]


def make_batch(lengths: list[int], vocab: int, seed: int = 0):
    import torch

    from hosted_tinker.core.types import DatumInput, ForwardBackwardBatch

    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        tokens = torch.from_numpy(rng.integers(10, vocab, n + 1))
        data.append(DatumInput(tokens[:-1], tokens[1:], {"weights": torch.ones(n)}))
    return ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)


def mean_context(lengths: list[int]) -> float:
    """The causal context a token attends over, on average over the tokens: Σ N²/2 / Σ N."""
    return sum(n * n / 2 for n in lengths) / sum(lengths)


def trainer_on(model: str, device: str, dtype: str, **options: Any):
    """A trainer in this process. Under the token threshold unless told otherwise: a GPU rank's
    default, ``activation_memory_gib=auto``, stores what the memory free at each micro-batch
    allows, and these paths are compared under one fixed rule (activation_memory.py compares the
    two rules)."""
    from hosted_tinker.rank.plans import PlanOptions
    from hosted_tinker.rank.serve import local_rank

    if "activation_memory_gib" not in options:
        options.setdefault("recompute_above_tokens", PlanOptions.model_fields["recompute_above_tokens"].default)
    return local_rank(model, device=device, dtype=dtype, **options).trainer


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    """Seconds ``fn()`` took on ``device``, and what it returned."""
    sync(device)
    start = time.perf_counter()
    value = fn()
    sync(device)
    return time.perf_counter() - start, value


def free_cached(device: str) -> None:
    """After a path ran out of memory: what the allocator caches goes back before the next path."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def efficiency(flops: dict[str, float], tokens: int, seconds: float, peak: float | None) -> dict[str, float]:
    out = {"tokens_per_s": tokens / seconds, "achieved_tflops_6p": flops["model_flops_6p"] * tokens / seconds / 1e12}
    if peak:
        out["mfu_6p"] = out["achieved_tflops_6p"] / peak
    return out


# ---- mixed lengths: packed against padded ----------------------------------------------------


def scenario_mixed(args: argparse.Namespace) -> dict[str, Any]:
    from tests.support.batches import padded_microbatches, padded_path

    model = random_model(args.mixed_shape, args.dtype)
    vocab = vocab_size(model)
    lengths = lengths_skewed(16, 64, 4096, seed=1)
    batch = make_batch(lengths, vocab)
    tokens = sum(lengths)
    trainer = trainer_on(model, args.device, args.dtype)
    trainer.microbatch_tokens = args.microbatch_tokens or trainer.microbatch_tokens
    trainer.create_adapter("m", lora_spec())
    seen = {"packed": 0, "padded": 0}
    embed = trainer.model.base.get_input_embeddings()
    path = {"now": "packed"}
    hook = embed.register_forward_hook(lambda m, a, o: seen.__setitem__(path["now"], seen[path["now"]] + a[0].numel()))

    def packed() -> float:
        return trainer.forward_backward("m", batch).loss_sum

    def padded() -> float:
        with padded_path(trainer):
            return trainer.forward_backward("m", batch).loss_sum

    # The padded path stores every layer's activations: on a large model its micro-batches may not
    # fit (Qwen3-8B's shape, 16K-token micro-batches, an H200): a path that fails is recorded, and
    # --microbatch-tokens gives both paths micro-batches that fit (up to 8,192 tokens the packed
    # path stores every layer too, so the two then differ in their padding alone).
    seconds: dict[str, list[float]] = {"packed": [], "padded": []}
    losses: dict[str, float] = {}
    failed: dict[str, str] = {}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name, fn in (("packed", packed), ("padded", padded)):
            if name in failed:
                continue
            path["now"] = name
            seen[name] = 0
            try:
                t, losses[name] = timed(fn, args.device)
            except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
                record_failure(failed, name, e)
                free_cached(args.device)
                continue
            if round_:
                seconds[name].append(t)
    hook.remove()
    flops = flops_per_token(model, mean_context(lengths), LORA_RANK)
    peak = peak_tflops(args)
    median = {name: statistics.median(s) for name, s in seconds.items() if name not in failed}
    groups = padded_microbatches(batch.data, trainer.microbatch_tokens)
    both = not failed
    return {
        "model": args.mixed_shape,
        "lengths": lengths,
        "tokens": tokens,
        "flops_per_token": flops,
        "microbatch_tokens": trainer.microbatch_tokens,
        "step_s_median": median,
        "paths": {name: efficiency(flops, tokens, s, peak) for name, s in median.items()},
        "failed": failed,
        "tokens_computed": {name: seen[name] for name in median},
        "pad_tokens_computed": {name: seen[name] - tokens for name in median},
        "padded_tokens_by_grouping": sum(len(group) * max(lengths[i] for i in group) for group in groups),
        "speedup_packed_over_padded": median["padded"] / median["packed"] if both else None,
        "loss_sum": losses,
        "losses_equal_rtol_1e-5": bool(np.isclose(losses["packed"], losses["padded"], rtol=1e-5)) if both else None,
        # bfloat16 rounds each path's differently shaped products differently (1.1e-5 on Qwen3-8B's
        # shape on an H200): the 1e-5 bound is float32's, which the tests check
        "loss_sum_rel_diff": abs(losses["packed"] - losses["padded"]) / abs(losses["padded"]) if both else None,
    }


# ---- tenants: one pass for many models against one model at a time ----------------------------


def scenario_tenants(args: argparse.Namespace, shape: str | None) -> dict[str, Any]:
    from hosted_tinker.core.tiny_model import build_tiny_model

    model = random_model(shape, args.dtype) if shape else str(build_tiny_model(ROOT / ".bench-tiny" / "tiny-qwen3"))
    vocab = vocab_size(model)
    trainer = trainer_on(model, args.device, args.dtype)
    ids = [f"t{i}" for i in range(args.tenants)]
    for i, model_id in enumerate(ids):
        trainer.create_adapter(model_id, lora_spec(seed=i))
    batches = {model_id: make_batch([256], vocab, seed=i) for i, model_id in enumerate(ids)}
    tokens = 256 * len(ids)

    def alone() -> list[float]:
        return [trainer.forward_backward(m, b).loss_sum for m, b in batches.items()]

    def together() -> list[float]:
        return [r.loss_sum for r in trainer.forward_backward_many(list(batches.items()))]

    # The ceiling of a joint pass: the same tokens as one model's batch, under one adapter.
    one_model = replace(batches[ids[0]], data=[d for b in batches.values() for d in b.data])

    def ceiling() -> list[float]:
        return [trainer.forward_backward(ids[0], one_model).loss_sum]

    seconds: dict[str, list[float]] = {"one_at_a_time": [], "one_pass": [], "one_model_same_tokens": []}
    losses: dict[str, list[float]] = {}
    for round_ in range(args.rounds + 1):
        for name, fn in (("one_at_a_time", alone), ("one_pass", together), ("one_model_same_tokens", ceiling)):
            t, losses[name] = timed(fn, args.device)
            if round_:
                seconds[name].append(t)
    flops = flops_per_token(model, mean_context([256]), LORA_RANK)
    peak = peak_tflops(args)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    return {
        "model": shape or "built-in tiny Qwen3",
        "tenants": len(ids),
        "tokens": tokens,
        "flops_per_token": flops,
        "step_s_median": median,
        "paths": {name: efficiency(flops, tokens, s, peak) for name, s in median.items()},
        "speedup_one_pass_over_one_at_a_time": median["one_at_a_time"] / median["one_pass"],
        "speedup_ceiling_one_model_over_one_at_a_time": median["one_at_a_time"] / median["one_model_same_tokens"],
        "loss_sum": {name: losses[name] for name in ("one_at_a_time", "one_pass")},
        "losses_equal_rtol_1e-5": bool(np.allclose(losses["one_pass"], losses["one_at_a_time"], rtol=1e-5)),
    }


# ---- long: memory against sequence length ---------------------------------------------------------


def long_child(args: argparse.Namespace) -> None:
    """One forward_backward of one sequence of ``--child-tokens``, in this fresh process; prints
    its memory and time as JSON."""
    import torch

    model = random_model(args.long_shape, args.dtype)
    vocab = vocab_size(model)
    threshold = 0 if args.child_recompute else 10**9
    trainer = trainer_on(model, args.device, args.dtype, recompute_above_tokens=threshold, microbatch_tokens=10**6)
    trainer.create_adapter("long", lora_spec())
    trainer.forward_backward("long", make_batch([64], vocab, seed=1))  # weights paged in, allocator warm
    batch = make_batch([args.child_tokens], vocab)
    before = memory.rss_bytes()
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    seconds, _ = timed(lambda: trainer.forward_backward("long", batch), args.device)
    if args.device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = memory.snapshot()["rss_peak"]
    print(json.dumps({"tokens": args.child_tokens, "before": before, "peak": peak, "seconds": seconds}))


def scenario_long(args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in args.lengths.split(",")]
    points: dict[str, list[dict]] = {"recomputed": [], "stored": []}
    random_model(args.long_shape, args.dtype)  # written once, before the children read it
    for recompute, name in ((True, "recomputed"), (False, "stored")):
        for n in lengths:
            if not recompute and n > args.stored_max_tokens:
                continue
            command = [sys.executable, __file__, "--child-tokens", str(n), "--long-shape", args.long_shape]
            command += ["--device", args.device, "--dtype", args.dtype] + (["--child-recompute"] if recompute else [])
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            point = json.loads(out.strip().splitlines()[-1])
            point["step_bytes"] = point["peak"] - point["before"]
            points[name].append(point)
            print(
                f"  long {name:10} {n:6} tokens: {point['step_bytes'] / 2**30:7.2f} GiB over the model, "
                f"{point['seconds']:7.1f} s",
                flush=True,
            )
    model = random_model(args.long_shape, args.dtype)
    fits = {}
    for name, pts in points.items():
        if len(pts) >= 2:
            x = np.array([p["tokens"] for p in pts], dtype=float)
            y = np.array([p["step_bytes"] for p in pts], dtype=float)
            slope, intercept = np.polyfit(x, y, 1)
            residual = float(np.max(np.abs(y - (slope * x + intercept))) / np.max(y))
            fits[name] = {"bytes_per_token": float(slope), "intercept_bytes": float(intercept)}
            fits[name]["max_rel_residual"] = residual
    return {
        "model": args.long_shape,
        "points": points,
        "linear_fit": fits,
        "flops_per_token": {n: flops_per_token(model, n / 2, LORA_RANK) for n in lengths},
    }


# ---- adapters: the cost of one more model against how many are resident --------------------------


def scenario_adapters(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds to add one adapter with ``resident`` already on the rank: ours (plain parameters
    and a hook per layer, ``rank.adapters``) against PEFT's ``add_adapter`` on the same base, which
    walks every module of every resident adapter. Adding runs on the thread all training waits on."""
    import torch
    from peft import LoraConfig, get_peft_model

    from hosted_tinker.rank.model import load_base

    model = random_model(args.adapters_shape, args.dtype)
    trainer = trainer_on(model, args.device, args.dtype)
    modules = [m for group in ("attn", "mlp", "unembed") for m in trainer.model.targets[group]]
    peft = get_peft_model(
        load_base(model, torch.device(args.device), args.dtype),
        LoraConfig(r=LORA_RANK, lora_alpha=32, target_modules=modules),
        adapter_name="p0",
    )
    marks = sorted({1, args.adapters // 4, args.adapters})
    seconds: dict[str, dict[int, float]] = {"ours": {}, "peft": {}}
    for i in range(1, args.adapters + 1):
        t_ours, _ = timed(lambda i=i: trainer.create_adapter(f"m{i}", lora_spec(seed=i)), args.device)
        t_peft, _ = timed(lambda i=i: peft.add_adapter(f"p{i}", peft.peft_config["p0"]), args.device)
        if i in marks:  # i - 1 adapters resident before it
            seconds["ours"][i], seconds["peft"][i] = t_ours, t_peft
            print(f"  adapters: add #{i}: ours {t_ours:.3f} s, peft {t_peft:.3f} s", flush=True)
    return {"model": args.adapters_shape, "add_s_by_count": seconds}


def lora_spec(seed: int = 0):
    from hosted_tinker.core.types import LoraSpec

    return LoraSpec(rank=LORA_RANK, seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=["all", "mixed", "tenants", "long", "adapters"], default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak (default on H100/H200)")
    parser.add_argument("--mixed-shape", default="qwen3-h512-l4")
    parser.add_argument(
        "--microbatch-tokens", type=int, default=None, help="the mixed scenario's micro-batches (default: 16384)"
    )
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--tenants-shape", default="qwen-0.5b", help="besides the tiny model ('' for none)")
    parser.add_argument("--long-shape", default="qwen3-h1024-l4")
    parser.add_argument("--adapters", type=int, default=64, help="the adapters scenario adds this many")
    parser.add_argument("--adapters-shape", default="qwen-0.5b")
    parser.add_argument("--lengths", default="8192,16384,32768", help="the long scenario's sequence lengths")
    parser.add_argument("--stored-max-tokens", type=int, default=32768, help="longest run without recomputation")
    parser.add_argument("--child-tokens", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-recompute", action="store_true", help=argparse.SUPPRESS)
    add_common_args(parser)
    args = parser.parse_args()
    if args.child_tokens is not None:
        return long_child(args)

    import torch

    torch.manual_seed(0)
    results: dict[str, Any] = {**result_header("train_efficiency", args.device), "lora_rank": LORA_RANK}
    results["peak_tflops"] = peak_tflops(args)
    rows: list[tuple[str, str]] = []
    if args.scenario in ("all", "mixed"):
        mixed = results["mixed"] = scenario_mixed(args)
        for name, e in mixed["paths"].items():
            rows.append((f"mixed {name}", _row(mixed["step_s_median"][name], e)))
        rows += [(f"mixed {name}: FAILED", reason[:60]) for name, reason in mixed["failed"].items()]
        rows.append(("mixed: pad tokens computed (packed, padded)", str(tuple(mixed["pad_tokens_computed"].values()))))
        if mixed["speedup_packed_over_padded"] is not None:
            rows.append(("mixed: packed speed-up over padded", f"{mixed['speedup_packed_over_padded']:.2f}x"))
    if args.scenario in ("all", "tenants"):
        results["tenants"] = [scenario_tenants(args, None)]
        if args.tenants_shape:
            results["tenants"].append(scenario_tenants(args, args.tenants_shape))
        for t in results["tenants"]:
            for name, e in t["paths"].items():
                rows.append((f"tenants ({t['model']}) {name}", _row(t["step_s_median"][name], e)))
            speedup = t["speedup_one_pass_over_one_at_a_time"]
            ceiling = t["speedup_ceiling_one_model_over_one_at_a_time"]
            rows.append((f"tenants ({t['model']}): one pass speed-up", f"{speedup:.2f}x (ceiling {ceiling:.2f}x)"))
    if args.scenario in ("all", "long"):
        long = results["long"] = scenario_long(args)
        for name, pts in long["points"].items():
            for point in pts:
                gib = point["step_bytes"] / 2**30
                rows.append(
                    (f"long {name} {point['tokens']} tokens", f"{gib:.2f} GiB over the model, {point['seconds']:.0f} s")
                )
        for name, fit in long["linear_fit"].items():
            rows.append((f"long {name}: activation bytes / token", f"{fit['bytes_per_token']:,.0f}"))
    if args.scenario in ("all", "adapters"):
        adapters = results["adapters"] = scenario_adapters(args)
        for count, ours in adapters["add_s_by_count"]["ours"].items():
            theirs = adapters["add_s_by_count"]["peft"][count]
            label = f"adapters ({adapters['model']}): add #{count}"
            rows.append((label, f"{ours:.3f} s (PEFT's add_adapter {theirs:.3f} s)"))
    print_table(f"training efficiency on {results['device']}", rows)
    write_results(results, args.out, args.device)


def _row(seconds: float, e: dict[str, float]) -> str:
    mfu = f"   MFU {100 * e['mfu_6p']:.1f} %" if "mfu_6p" in e else ""
    rate = f"{e['tokens_per_s']:9.0f} tok/s  {e['achieved_tflops_6p'] * 1000:8.1f} GFLOP/s"
    return f"{1000 * seconds:9.1f} ms  {rate}{mfu}"


if __name__ == "__main__":
    main()
