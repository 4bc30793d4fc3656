"""How long does one big request body hold up every other request? A probe thread asks /healthz
every 10 ms while big JSON bodies arrive one after another, and reports its latency (p50, p99,
max) with no body arriving (the baseline, in the same run) and during each kind of body:

- ``prompt``: an asample body of ``--mib`` MiB (a prompt of millions of tokens: decoded and
  validated like any prompt, then refused as longer than the context);
- ``bad items``: an asample body whose target logprobs are a million strings (before
  ``protocol.strict``, two validation errors each);
- ``unknown fields``: an asample body with a million unknown fields;
- ``v1 prompt``: a /v1/completions body of ``--mib`` MiB of prompt token ids;
- ``batch``: a forward_backward body (protobuf) of ``--batch-mib`` MiB, more tokens than a
  request may hold (decoded on a thread, then refused).

    python benchmarks/big_bodies.py [--mib 30 --rounds 3]

Prints a table and writes benchmarks/results/big_bodies-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import add_common_args, model_label, print_table, result_header, setup, write_results  # noqa: E402
from tests.support.server import ALIAS, start_server  # noqa: E402

PROBE_EVERY_S = 0.01


class Probe:
    """A thread that times /healthz every ``PROBE_EVERY_S`` into the current bucket."""

    def __init__(self, base_url: str) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=120)
        self.samples: dict[str, list[float]] = {}
        self.bucket: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            bucket, start = self.bucket, time.perf_counter()
            self.client.get("/healthz").raise_for_status()
            if bucket is not None and bucket == self.bucket:
                self.samples.setdefault(bucket, []).append(time.perf_counter() - start)
            self._stop.wait(PROBE_EVERY_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()


def bodies(sampler_id: str, mib: int, vocab: int) -> dict[str, Callable[[], tuple[str, bytes]]]:
    """Each kind of body: a function that gives its route and its bytes."""
    rng = np.random.default_rng(0)
    some = rng.integers(10, vocab - 1, 1000).tolist()
    per_token = len(json.dumps(some)) / len(some)  # bytes in JSON
    tokens = rng.integers(10, vocab - 1, int((mib << 20) / per_token)).tolist()
    params = {"sampling_session_id": sampler_id, "sampling_params": {"max_tokens": 4}, "num_samples": 1}
    prompt = {"chunks": [{"type": "encoded_text", "tokens": tokens}]}
    small = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}
    return {
        "prompt": lambda: ("/api/v1/asample", json.dumps({**params, "prompt": prompt}).encode()),
        "bad items": lambda: (
            "/api/v1/asample",
            json.dumps({**params, "prompt": small, "target_prompt_logprobs": {"data": ["a"] * 10**6}}).encode(),
        ),
        "unknown fields": lambda: (
            "/api/v1/asample",
            json.dumps({**params, "prompt": small, **{f"k{i}": 0 for i in range(10**6)}}).encode(),
        ),
        "v1 prompt": lambda: ("/v1/completions", json.dumps({"model": ALIAS, "prompt": tokens}).encode()),
    }


def batch(model_id: str, mib: int) -> Callable[[int], bytes]:
    """A forward_backward body of ``mib`` MiB for each seq_id: datums of 16K positions."""
    from tinker.proto import tinker_public_pb2 as pb

    n = 16384
    positions = np.arange(n)
    req = pb.ForwardBackwardRequest(model_id=model_id, loss_fn="cross_entropy")
    for _ in range((mib << 20) // (n * 16)):  # tokens int32, targets int64, weights float32
        d = req.data.add()
        d.model_input.add().encoded_text.tokens = (positions % 100 + 10).astype("<i4").tobytes()
        targets = (positions % 100 + 11).astype("<i8")
        d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=targets.tobytes(), dtype=pb.DTYPE_INT64, shape=[n]))
        weights = np.ones(n, "<f4").tobytes()
        d.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dense=weights, dtype=pb.DTYPE_FLOAT32, shape=[n]))

    def with_seq(seq_id: int) -> bytes:
        req.seq_id = seq_id
        return req.SerializeToString()

    return with_seq


def result(http: httpx.Client, request_id: str) -> dict:
    while True:  # retrieve_future long-polls: no sleep needed
        answer = http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        if answer.get("type") != "try_again":
            return answer


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "n": len(xs),
        "p50_ms": 1000 * statistics.median(xs),
        "p99_ms": 1000 * xs[min(len(xs) - 1, int(0.99 * len(xs)))],
        "max_ms": 1000 * xs[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=30, help="size of the prompt bodies (under the 32 MiB limit)")
    parser.add_argument("--batch-mib", type=int, default=128, help="size of the forward_backward bodies")
    parser.add_argument("--rounds", type=int, default=3, help="bodies of each kind, one after another")
    add_common_args(parser)
    args = parser.parse_args()

    work, model, vocab = setup(args.model)
    server = start_server(work, "--model", model, "--device", args.device)
    results = {**result_header("big_bodies", args.device), "workload": {"model": model_label(args.model)}}
    try:
        http = httpx.Client(base_url=server.base_url, timeout=300)
        session = http.post("/api/v1/create_session", json={}).json()["session_id"]
        body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": ALIAS}
        sampler_id = http.post("/api/v1/create_sampling_session", json=body).json()["sampling_session_id"]
        body = {"session_id": session, "model_seq_id": 0, "base_model": ALIAS, "lora_config": {"rank": 4}}
        model_id = result(http, http.post("/api/v1/create_model", json=body).json()["request_id"])["model_id"]
        batches = batch(model_id, args.batch_mib)
        kinds = bodies(sampler_id, args.mib, vocab)
        kinds["batch"] = lambda: ("/api/v1/forward_backward", b"")
        probe = Probe(server.base_url)
        time.sleep(2.0)  # the server's first sweeps, and the probe's first connection
        probe.bucket = "idle"
        time.sleep(5.0)  # the baseline: the probe alone
        probe.bucket = None
        sizes, statuses, seconds = {}, {}, {}
        for kind, make in kinds.items():
            route, content = make()
            contents = [batches(seq_id) for seq_id in range(1, 1 + args.rounds)] if kind == "batch" else None
            headers = {"Content-Type": "application/x-protobuf" if contents else "application/json"}
            sizes[kind] = len(contents[0]) if contents else len(content)
            probe.bucket = kind
            start = time.perf_counter()
            for i in range(args.rounds):
                reply = http.post(route, content=contents[i] if contents else content, headers=headers)
                statuses[kind] = reply.status_code
            seconds[kind] = (time.perf_counter() - start) / args.rounds
            probe.bucket = None
        probe.close()
        http.close()
    finally:
        server.stop()

    idle = percentiles(probe.samples["idle"])
    rows, kinds = [("idle (baseline)", _row(idle, idle))], {}
    for kind in sizes:
        stats = percentiles(probe.samples.get(kind, [float("nan")]))
        kinds[kind] = {"body_bytes": sizes[kind], "status": statuses[kind], "seconds_per_body": seconds[kind], **stats}
        rows.append((f"{kind} ({sizes[kind] / 2**20:.1f} MiB, {statuses[kind]})", _row(stats, idle)))
    results |= {"rounds": args.rounds, "probe_every_s": PROBE_EVERY_S, "idle": idle, "during": kinds}
    print_table("/healthz latency while big bodies arrive (p50 / p99 / max; max over idle p99)", rows)
    write_results(results, args.out, args.device)


def _row(stats: dict[str, float], idle: dict[str, float]) -> str:
    ratio = stats["max_ms"] / idle["p99_ms"]
    return f"{stats['p50_ms']:7.1f} / {stats['p99_ms']:7.1f} / {stats['max_ms']:7.1f} ms  ({ratio:.0f}x)"


if __name__ == "__main__":
    main()
