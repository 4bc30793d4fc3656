"""How fast does the embedded sampling engine decode? 16 concurrent requests x 64 new tokens
through the tinker SDK against the server, next to a plain ``model.generate`` loop (and one
batched ``model.generate`` call) in this process, in one run; plus the same 16 requests sent one
after another through the SDK, to show what batching buys.

    python benchmarks/sampling.py [--requests 16 --new-tokens 64 --rounds 5 --model DIR]

Prints a table and writes benchmarks/results/sampling-<device>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import as_completed
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import (  # noqa: E402
    add_common_args,
    busy_cpu_seconds,
    model_label,
    print_table,
    process_tree,
    result_header,
    setup,
    write_results,
)
from tests.support.server import ALIAS, start_server  # noqa: E402


def make_prompts(n: int, vocab: int, shortest: int, longest: int, seed: int = 0) -> list[list[int]]:
    """Distinct prompts, lengths spread evenly over [shortest, longest], ids clear of special tokens."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(shortest, longest, n).round().astype(int)
    return [rng.integers(10, vocab - 1, int(length)).tolist() for length in lengths]


class HfGenerate:
    """The baseline: ``transformers`` ``model.generate`` in this process, no server involved."""

    def __init__(self, model: str, prompts: list[list[int]], new_tokens: int, device: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.lm = AutoModelForCausalLM.from_pretrained(model).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.new_tokens = new_tokens
        self.singles = [torch.tensor([p], device=device) for p in prompts]
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for r, p in enumerate(prompts):  # left-padded
            ids[r, longest - len(p) :] = torch.tensor(p)
            mask[r, longest - len(p) :] = 1
        self.batch_ids, self.batch_mask = ids.to(device), mask.to(device)

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor) -> int:
        out = self.lm.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=self.new_tokens,
            min_new_tokens=self.new_tokens,  # no early EOS: every row makes exactly new_tokens
            do_sample=True,
            pad_token_id=self.pad_id,
        )
        made = out.shape[1] - ids.shape[1]
        assert made == self.new_tokens, f"generate made {made} tokens, expected {self.new_tokens}"
        return made * ids.shape[0]

    @torch.no_grad()
    def sequential(self) -> tuple[float, int]:
        """One ``generate`` call per request, batch 1, one after another."""
        start = time.perf_counter()
        tokens = sum(self._generate(ids, torch.ones_like(ids)) for ids in self.singles)
        return time.perf_counter() - start, tokens

    @torch.no_grad()
    def batched(self) -> tuple[float, int]:
        """All requests in one left-padded ``generate`` call."""
        start = time.perf_counter()
        tokens = self._generate(self.batch_ids, self.batch_mask)
        return time.perf_counter() - start, tokens


class OverHttp:
    """The server's embedded engine, sampling the base model through the tinker SDK."""

    def __init__(self, base_url: str, prompts: list[list[int]], new_tokens: int) -> None:
        import tinker
        from tinker import types

        self.inputs = [types.ModelInput.from_ints(p) for p in prompts]
        self.params = [
            types.SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=i, stop=[])  # stop=[]: no EOS
            for i in range(len(prompts))
        ]
        self.new_tokens = new_tokens
        self.service = tinker.ServiceClient(base_url=base_url)
        self.client = self.service.create_sampling_client(base_model=ALIAS).result()

    def _tokens(self, response) -> int:
        made = [len(s.tokens) for s in response.sequences]
        assert made == [self.new_tokens], f"server made {made} tokens, expected [{self.new_tokens}]"
        return made[0]

    def concurrent(self) -> tuple[float, int, list[float]]:
        """Submit every request at once, then wait on all; also each request's submit-to-result time."""
        start = time.perf_counter()
        futures = [
            self.client.sample(x, num_samples=1, sampling_params=p)
            for x, p in zip(self.inputs, self.params, strict=True)
        ]
        tokens, latencies = 0, []
        for future in as_completed([f.future() for f in futures]):
            latencies.append(time.perf_counter() - start)
            tokens += self._tokens(future.result())
        return time.perf_counter() - start, tokens, latencies

    def sequential(self) -> tuple[float, int]:
        """The same requests, each sent only after the previous one's result came back."""
        start = time.perf_counter()
        tokens = 0
        for x, p in zip(self.inputs, self.params, strict=True):
            tokens += self._tokens(self.client.sample(x, num_samples=1, sampling_params=p).result())
        return time.perf_counter() - start, tokens

    def close(self) -> None:
        self.service.close("success").result()


def run_rounds(local: HfGenerate, remote: OverHttp, rounds: int, warmup: int) -> dict[str, list]:
    """Alternate the four paths within each round so that drifting machine load hits them alike."""
    out: dict[str, list] = {k: [] for k in ("server_concurrent", "server_sequential", "hf_sequential", "hf_batched")}
    out["server_concurrent_latencies"] = []
    for _ in range(warmup):
        remote.concurrent()
        remote.sequential()
        local.sequential()
        local.batched()
    for _ in range(rounds):
        seconds, tokens, latencies = remote.concurrent()
        out["server_concurrent"].append(tokens / seconds)
        out["server_concurrent_latencies"].append(latencies)
        seconds, tokens = remote.sequential()
        out["server_sequential"].append(tokens / seconds)
        seconds, tokens = local.sequential()
        out["hf_sequential"].append(tokens / seconds)
        seconds, tokens = local.batched()
        out["hf_batched"].append(tokens / seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-min", type=int, default=16, help="shortest prompt (tokens)")
    parser.add_argument("--prompt-max", type=int, default=48, help="longest prompt (tokens)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    add_common_args(parser)
    args = parser.parse_args()

    work, model, vocab = setup(args.model)
    prompts = make_prompts(args.requests, vocab, args.prompt_min, args.prompt_max)

    local = HfGenerate(model, prompts, args.new_tokens, args.device)
    server = start_server(work, "--model", model, "--device", args.device)
    try:
        remote = OverHttp(server.base_url, prompts, args.new_tokens)
        pids = [os.getpid(), *process_tree(server.proc.pid)]  # the server with its worker
        cpu_before, wall_before = busy_cpu_seconds(pids), time.perf_counter()
        rates = run_rounds(local, remote, args.rounds, args.warmup)
        cpu_after, wall = busy_cpu_seconds(pids), time.perf_counter() - wall_before
        remote.close()
    finally:
        server.stop()

    med = {k: statistics.median(v) for k, v in rates.items() if k != "server_concurrent_latencies"}
    latencies = [x for round_ in rates["server_concurrent_latencies"] for x in round_]
    mid = sorted(range(args.rounds), key=lambda r: rates["server_concurrent"][r])[args.rounds // 2]
    # CPU time that neither this process nor the server used while the rounds ran: other load on
    # the machine, which the timings would suffer from (with 2 cores, badly: torch's threads wait
    # on each other at every op).
    foreign = None
    if cpu_before is not None and cpu_after is not None:
        foreign = (cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1])
    results = {
        **result_header("sampling", args.device),
        "workload": {
            "requests": args.requests,
            "new_tokens_per_request": args.new_tokens,
            "prompt_tokens": [len(p) for p in prompts],
            "sampling": "temperature 1.0, no top-k/top-p, EOS disabled (server: stop=[]; HF: min_new_tokens)",
            "rounds": args.rounds,
            "warmup_rounds": args.warmup,
            "model": model_label(args.model),
        },
        "tokens_per_s_median": {
            "server_concurrent": med["server_concurrent"],
            "server_sequential": med["server_sequential"],
            "hf_generate_sequential_loop": med["hf_sequential"],
            "hf_generate_one_batched_call": med["hf_batched"],
        },
        "tokens_per_s_per_round": {k: v for k, v in rates.items() if k != "server_concurrent_latencies"},
        "ratios": {
            "server_concurrent_over_hf_sequential_loop": med["server_concurrent"] / med["hf_sequential"],
            "server_concurrent_over_hf_batched": med["server_concurrent"] / med["hf_batched"],
            "server_concurrent_over_server_sequential": med["server_concurrent"] / med["server_sequential"],
        },
        "server_concurrent_request_latency_s": {
            "median": statistics.median(latencies),
            "min": min(latencies),
            "max": max(latencies),
            # Completion times of the median round: clusters show how the server split it into batches.
            "median_round_sorted": [round(x, 3) for x in sorted(rates["server_concurrent_latencies"][mid])],
        },
        "measurement_wall_s": wall,
        "other_processes_cpu_s_during_measurement": foreign,
        "notes": [
            "tokens/s counts new tokens only: requests x new_tokens / wall time, first submit to last result.",
            "Server numbers include HTTP, the tinker SDK (futures, retrieve_future polling) and the scheduler; "
            "HF numbers are bare model.generate calls in the benchmark process.",
            "Server and benchmark process run on the same CPU cores; the paths are timed one at a time, "
            "alternating within each round.",
            "server_concurrent_request_latency_s.median_round_sorted: each request's submit-to-result time; "
            "a step between groups means the server sampled them in separate batches.",
            "other_processes_cpu_s_during_measurement: CPU time used on the machine by anything but the two "
            "benchmark processes while the rounds ran; with few cores, such load slows tiny-model torch ops "
            "far more than in proportion, so a run with a large value is not representative.",
        ],
    }
    rows = [
        (f"server, {args.requests} concurrent requests (SDK over HTTP)", med["server_concurrent"]),
        (f"server, {args.requests} requests one after another", med["server_sequential"]),
        ("model.generate loop, batch 1 each", med["hf_sequential"]),
        (f"model.generate, one batched call of {args.requests}", med["hf_batched"]),
    ]
    ratios = [
        ("server concurrent / HF loop", "server_concurrent_over_hf_sequential_loop"),
        ("server concurrent / HF batched", "server_concurrent_over_hf_batched"),
        ("server concurrent / server sequential", "server_concurrent_over_server_sequential"),
    ]
    print_table(
        f"sampling on {results['device']}: {args.requests} requests x {args.new_tokens} new tokens, "
        f"prompts {args.prompt_min}-{args.prompt_max} tokens, median of {args.rounds} rounds",
        [(name, f"{value:>8.0f} tok/s") for name, value in rows]
        + [(name, f"{results['ratios'][key]:>8.2f}x") for name, key in ratios],
    )
    if foreign is not None:
        print(f"  other processes' CPU while measuring: {foreign:.1f} s of {wall:.1f} s wall")
    write_results(results, args.out, args.device)


if __name__ == "__main__":
    main()
