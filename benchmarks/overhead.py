"""What does going through the server cost? The same SFT loop, via the tinker SDK over HTTP and
via the backend called in-process, in one run; plus per-call latencies of optim_step and of a
retrieve_future on an already finished result.

    python benchmarks/overhead.py [--steps 20 --batch 8 --seq-len 256 --model DIR]

Prints a table and writes benchmarks/results/overhead-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import add_common_args, model_label, print_table, result_header, setup, write_results  # noqa: E402
from hosted_tinker.core.types import AdamParams, DatumInput, ForwardBackwardBatch, LoraSpec  # noqa: E402
from hosted_tinker.rank.serve import local_rank  # noqa: E402
from tests.support.server import ALIAS, start_server  # noqa: E402


def make_batch(batch: int, seq_len: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 1, seq_len + 1) for _ in range(batch)]


class InProcess:
    """The PEFT backend called directly: the baseline with no HTTP, SDK or scheduler."""

    def __init__(self, model: str, seqs: list[np.ndarray], lr: float, device: str) -> None:
        self.backend = local_rank(model, device=device).trainer
        self.backend.create_adapter("bench", LoraSpec(rank=32, seed=0))
        data = [
            DatumInput(
                tokens=torch.from_numpy(s[:-1]),
                target_tokens=torch.from_numpy(s[1:]),
                inputs={"weights": torch.ones(len(s) - 1)},
            )
            for s in seqs
        ]
        self.batch = ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)
        self.adam = AdamParams(learning_rate=lr)

    def step(self) -> tuple[float, float]:
        start = time.perf_counter()
        result = self.backend.forward_backward("bench", self.batch)
        self.backend.optim_step("bench", self.adam)
        return time.perf_counter() - start, result.loss_sum

    def empty_optim_step(self) -> float:
        start = time.perf_counter()
        self.backend.optim_step("bench", AdamParams(learning_rate=0.0))
        return time.perf_counter() - start


class OverHttp:
    """The same work through the tinker SDK against the server."""

    def __init__(self, base_url: str, seqs: list[np.ndarray], lr: float) -> None:
        import tinker
        from tinker import types

        self.types = types
        self.data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(s[:-1].tolist()),
                loss_fn_inputs={"target_tokens": s[1:].tolist(), "weights": [1.0] * (len(s) - 1)},
            )
            for s in seqs
        ]
        self.adam = types.AdamParams(learning_rate=lr)
        self.service = tinker.ServiceClient(base_url=base_url)
        self.client = self.service.create_lora_training_client(base_model=ALIAS, rank=32, seed=0).result()

    def step(self) -> tuple[float, float]:
        start = time.perf_counter()
        fb = self.client.forward_backward(self.data, "cross_entropy")
        op = self.client.optim_step(self.adam)
        result = fb.result()
        op.result()
        return time.perf_counter() - start, result.metrics["loss:sum"]

    def empty_optim_step(self) -> float:
        start = time.perf_counter()
        self.client.optim_step(self.types.AdamParams(learning_rate=0.0)).result()
        return time.perf_counter() - start

    def close(self) -> None:
        self.service.close("success").result()


def run_rounds(local: InProcess, remote: OverHttp, rounds: int, steps: int, warmup: int) -> dict[str, list]:
    """Alternate blocks of steps so that drifting machine load hits both paths alike."""
    out: dict[str, list] = {k: [] for k in ("local", "remote", "local_loss", "remote_loss", "local_opt", "remote_opt")}
    for _ in range(warmup):
        local.step()
        remote.step()
    for _ in range(rounds):
        for path, runner in (("local", local), ("remote", remote)):
            for _ in range(steps):
                seconds, loss = runner.step()
                out[path].append(seconds)
                out[f"{path}_loss"].append(loss)
            for _ in range(10):
                out[f"{path}_opt"].append(runner.empty_optim_step())
    return out


def retrieve_after_completion(base_url: str, repeats: int = 50) -> list[float]:
    """Latency of retrieve_future for a result that is already there (the SDK's final poll)."""
    with httpx.Client(base_url=base_url, headers={"X-API-Key": "tml-bench"}) as http:
        session = http.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        body = {"session_id": session, "model_seq_id": 0, "base_model": ALIAS, "lora_config": {"rank": 4}}
        request_id = http.post("/api/v1/create_model", json=body).json()["request_id"]
        http.post("/api/v1/retrieve_future", json={"request_id": request_id})  # wait for it once
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            r = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
            times.append(time.perf_counter() - start)
            assert r.status_code == 200 and "model_id" in r.json()
    return times


def ms(xs: list[float]) -> float:
    return 1000 * statistics.median(xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="steps per round and path")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    add_common_args(parser)
    args = parser.parse_args()

    work, model, vocab = setup(args.model)
    seqs = make_batch(args.batch, args.seq_len, vocab)

    local = InProcess(model, seqs, args.lr, args.device)
    server = start_server(work, "--model", model, "--device", args.device)
    try:
        remote = OverHttp(server.base_url, seqs, args.lr)
        timings = run_rounds(local, remote, args.rounds, args.steps, args.warmup)
        remote.close()
        retrieve = retrieve_after_completion(server.base_url)
    finally:
        server.stop()

    # Both paths train identical adapters on identical data, so their losses must agree.
    same_math = np.allclose(timings["local_loss"], timings["remote_loss"], rtol=1e-4)
    ratio = statistics.median(timings["remote"]) / statistics.median(timings["local"])
    results = {
        **result_header("overhead", args.device),
        "workload": {
            "batch": args.batch,
            "seq_len": args.seq_len,
            "steps_measured": args.steps * args.rounds,
            "rounds": args.rounds,
            "lora_rank": 32,
            "model": model_label(args.model),
        },
        "in_process_step_ms_median": ms(timings["local"]),
        "http_step_ms_median": ms(timings["remote"]),
        "ratio_http_over_in_process": ratio,
        "optim_step_in_process_ms_median": ms(timings["local_opt"]),
        "optim_step_sdk_call_ms_median": ms(timings["remote_opt"]),
        "optim_step_call_overhead_ms_median": ms(timings["remote_opt"]) - ms(timings["local_opt"]),
        "retrieve_future_finished_ms_median": ms(retrieve),
        "retrieve_future_finished_ms_p90": 1000 * float(np.percentile(retrieve, 90)),
        "losses_identical_in_both_paths": bool(same_math),
        "targets": {"ratio": 1.15, "per_call_overhead_ms_median": 10.0},
    }
    rows = [
        ("SFT step (fwd_bwd + optim), in-process", f"{results['in_process_step_ms_median']:.1f} ms"),
        ("SFT step (fwd_bwd + optim), SDK over HTTP", f"{results['http_step_ms_median']:.1f} ms"),
        ("ratio HTTP / in-process (target ≤ 1.15)", f"{ratio:.3f}"),
        ("optim_step (no grads) in-process", f"{results['optim_step_in_process_ms_median']:.2f} ms"),
        ("optim_step (no grads) SDK call, submit→result", f"{results['optim_step_sdk_call_ms_median']:.2f} ms"),
        ("optim_step per-call overhead (target < 10 ms)", f"{results['optim_step_call_overhead_ms_median']:.2f} ms"),
        ("retrieve_future of a finished result", f"{results['retrieve_future_finished_ms_median']:.2f} ms"),
        ("losses identical in both paths", str(same_math)),
    ]
    print_table(
        f"overhead on {results['device']}: batch {args.batch} x {args.seq_len} tokens, "
        f"{args.rounds} x {args.steps} steps",
        [(name, f"{value:>10}") for name, value in rows],
    )
    write_results(results, args.out, args.device)


if __name__ == "__main__":
    main()
