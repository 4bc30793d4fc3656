"""Routing replay on a small mixture-of-experts RL loop: how far the learner's log-probs are from
the sampler's (``sampler_logprob_gap``) with the sampler's expert choices replayed and without,
on the same data in the same step, through the real SDK and a live server.

Each step samples with ``record_stability_info`` (the embedded sampler records each token's
experts), then runs ``forward`` twice on the same datums: with provenance (their routing
replayed: ``rank.routing_replay``) and without (the learner's routers choose), then trains one
``importance_sampling`` step on them. In float32 sampler and learner agree to rounding and route
alike; in bfloat16 their numerics differ (a KV-cached decode against a packed forward) and
near-tied experts flip, which is what replay removes from the gap.

    python benchmarks/routing_replay.py                       # bfloat16, qwen3-moe-h512-l4, CPU
    python benchmarks/routing_replay.py --dtype float32 --steps 3

Writes benchmarks/results/routing_replay-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from benchmarks.report import print_table, result_header, write_results  # noqa: E402
from benchmarks.shapes import random_model  # noqa: E402
from tests.support.sdk import rl_datum  # noqa: E402
from tests.support.server import ALIAS, start_server  # noqa: E402

SHAPE = "qwen3-moe-h512-l4"  # 16 experts, 4 a token, 4 layers (benchmarks.shapes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="per prompt")
    parser.add_argument("--tokens", type=int, default=24, help="sampled per sequence")
    parser.add_argument("--out")
    args = parser.parse_args()

    model = random_model(SHAPE, args.dtype)
    work = Path(tempfile.mkdtemp(prefix="ht-replay-"))
    server = start_server(work / "data", "--model", model, "--dtype", args.dtype, alias=ALIAS)
    rng = np.random.default_rng(0)
    steps = []
    try:
        service = tinker.ServiceClient(base_url=server.base_url)
        tc = service.create_lora_training_client(base_model=ALIAS, rank=8, seed=1).result()
        for step in range(args.steps):
            sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
            params = types.SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=step, stop=[])
            data = []
            for _ in range(args.prompts):
                prompt = [int(t) for t in rng.integers(10, 500, 16)]
                seqs = sampler.sample(types.ModelInput.from_ints(prompt), args.samples, params).result().sequences
                rewards = [float(np.mean(np.asarray(s.tokens) % 2 == 0)) for s in seqs]  # even tokens
                mean = statistics.fmean(rewards)
                data += [rl_datum(s, r - mean, prompt) for s, r in zip(seqs, rewards, strict=True)]
            plain = [types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs) for d in data]
            replayed = tc.forward(data, "importance_sampling").result().metrics
            unreplayed = tc.forward(plain, "importance_sampling").result().metrics
            tc.forward_backward(data, "importance_sampling").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            steps.append(
                {
                    "step": step,
                    "gap_mean_without_replay": unreplayed["sampler_logprob_gap:mean"],
                    "gap_mean_with_replay": replayed["sampler_logprob_gap:mean"],
                    "gap_max_without_replay": unreplayed["sampler_logprob_gap:max"],
                    "gap_max_with_replay": replayed["sampler_logprob_gap:max"],
                    "routings_replayed": replayed["routing_replayed:mean"],
                    "routings_the_learner_would_change": replayed["routing_replay_changed:mean"],
                }
            )
    finally:
        server.stop()

    def mean(key: str) -> float:
        return statistics.fmean(s[key] for s in steps)

    summary = {k: mean(k) for k in steps[0] if k != "step"}
    results = {
        **result_header("routing_replay", "cpu"),
        "workload": {
            "model": f"{SHAPE} (random weights)",
            "dtype": args.dtype,
            "steps": args.steps,
            "sequences_per_step": args.prompts * args.samples,
            "sampled_tokens": args.tokens,
        },
        "steps": steps,
        "mean": summary,
    }
    print_table(
        f"routing replay, {SHAPE} {args.dtype}, mean over {args.steps} steps",
        [(k, f"{v:.3g}") for k, v in summary.items()],
    )
    out = args.out or str(ROOT / "benchmarks" / "results" / f"routing_replay-cpu-{args.dtype}.json")
    write_results(results, out, "cpu")


if __name__ == "__main__":
    main()
