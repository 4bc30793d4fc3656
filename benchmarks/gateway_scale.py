"""How many tenants can one gateway serve? The server runs with the benchmark-only
``synthetic`` backend option (forward_backward answers correctly shaped log-probs at once,
without running the model), so that what is measured is the gateway alone: HTTP, the codec,
sessions, seq_id ordering, futures and their store writes, the dispatch thread, the worker pipe.

For 1, 100 and 1,000 concurrent models (one SDK ServiceClient, async calls), each model's step is
``forward_backward`` (one datum of 64 tokens) then ``optim_step``, in two phases (``run_level``):
saturated (as fast as the gateway answers: its calls/s) and paced (one step per model per
``--period``: the latency a tenant sees at that load). Reported per level and phase: SDK
training calls per second, p50/p99 submit→result latency, errors, and CPU time per call of the
server (all its processes, from /proc) and of the client; then, for ``--profile-levels``, the
same level again under cProfile for where the event loop's work goes (HTTP stack, codec,
scheduler, store, the rest: shares of its busy time, start-up subtracted).

    python benchmarks/gateway_scale.py [--levels 1,100,1000 --seconds 20 --period 20]

Writes benchmarks/results/gateway_scale-cpu.json. The synthetic results are not training: no
test that claims correctness uses that option.
"""

from __future__ import annotations

import argparse
import asyncio
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import busy_cpu_seconds, print_table, process_tree, result_header, write_results  # noqa: E402
from tests.support.server import ALIAS, start_server  # noqa: E402

# Where the event loop's CPU goes, by the file a function lives in (first match wins).
PARTS = {
    "http": ("uvicorn", "h11", "httptools", "starlette", "fastapi", "anyio", "/asyncio/"),
    "codec": ("hosted_tinker/server/protocol", "google/protobuf", "zstandard", "pydantic"),
    "scheduler": ("hosted_tinker/server/scheduler.py", "hosted_tinker/server/serving/joint_passes.py"),
    "store": ("hosted_tinker/server/persistence/", "sqlite3"),
}


def datum(types, k: int):
    tokens = [(k * 7 + i) % 400 + 10 for i in range(65)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 64},
    )


def percentiles(xs: list[float]) -> dict[str, float]:
    return {q: 1000 * float(np.percentile(xs, p)) for q, p in (("p50", 50), ("p99", 99))} if xs else {}


class Phase:
    """One phase's figures: each call's submit→result latency by kind, and every error."""

    def __init__(self) -> None:
        self.latencies: dict[str, list[float]] = {"forward_backward": [], "optim_step": []}
        self.errors: list[str] = []

    async def timed(self, kind: str, submit) -> None:
        """One call, submitted (the SDK's APIFuture comes back at once) and awaited."""
        start = time.perf_counter()
        try:
            await submit()
        except Exception as e:  # every error is reported, none stops the run
            self.errors.append(f"{kind}: {type(e).__name__}: {e}")
            return
        self.latencies[kind].append(time.perf_counter() - start)

    def report(self, elapsed: float, client_cpu_s: float) -> dict[str, Any]:
        """Figures over ``elapsed`` seconds (the phase's length: at least one period when paced)."""
        every = [x for xs in self.latencies.values() for x in xs]
        return {
            "calls": len(every),
            "calls_per_s": len(every) / elapsed,
            "latency_ms": {kind: percentiles(xs) for kind, xs in self.latencies.items() if xs},
            "p50_ms_all": percentiles(every).get("p50"),
            "p99_ms_all": percentiles(every).get("p99"),
            "errors": len(self.errors),
            "first_errors": self.errors[:5],
            "client_cpu_ms_per_call": 1000 * client_cpu_s / max(1, len(every)),
        }


async def run_level(base_url: str, models: int, seconds: float, period: float, server_cpu) -> dict[str, Any]:
    """``models`` models on one SDK ServiceClient, in two phases: *saturated*, each model's next
    step submitted as soon as its last one finished, for ``seconds`` (the gateway's calls/s;
    latency there is models / throughput, Little's law); then *paced*, each model one step per
    ``period`` seconds at its own phase (offered load 2·models/period calls/s), one period long:
    the latency a tenant sees when the gateway is not the bottleneck."""
    import tinker
    from tinker import types

    adam = types.AdamParams(learning_rate=1e-4)
    level: dict[str, Any] = {"models": models}
    with tinker.ServiceClient(base_url=base_url) as sc:
        started = time.monotonic()
        clients = await asyncio.gather(
            *(sc.create_lora_training_client(base_model=ALIAS, rank=4) for _ in range(models))
        )
        level["create_s"] = time.monotonic() - started

        async def step(phase: Phase, i: int, k: int, tc) -> None:
            data = [datum(types, i + k)]
            await phase.timed("forward_backward", lambda: tc.forward_backward(data, "cross_entropy"))
            await phase.timed("optim_step", lambda: tc.optim_step(adam))

        async def saturated(phase: Phase, i: int, tc, stop_at: float) -> None:
            k = 0
            while time.monotonic() < stop_at:
                await step(phase, i, k, tc)
                k += 1

        async def paced(phase: Phase, i: int, tc, t0: float) -> None:
            await asyncio.sleep(max(0.0, t0 + period * i / models - time.monotonic()))
            await step(phase, i, 0, tc)

        for name in ("saturated", "paced"):
            phase = Phase()
            cpu0, server0, t0 = time.process_time(), server_cpu(), time.monotonic()
            if name == "saturated":
                await asyncio.gather(*(saturated(phase, i, tc, t0 + seconds) for i, tc in enumerate(clients)))
            else:
                await asyncio.gather(*(paced(phase, i, tc, t0) for i, tc in enumerate(clients)))
            elapsed = time.monotonic() - t0 if name == "saturated" else max(period, time.monotonic() - t0)
            level[name] = phase.report(elapsed, time.process_time() - cpu0)
            calls = level[name]["calls"]
            if calls and server0 is not None:
                level[name]["server_cpu_ms_per_call"] = 1000 * (server_cpu() - server0) / calls
        level["paced"]["offered_calls_per_s"] = 2 * models / period
    return level


IDLE = ("poll", "select", "epoll", "acquire", "sleep", "wait")  # the event loop waiting, not working


def breakdown(profile: Path) -> dict[str, float]:
    """Seconds the server's main thread (the event loop) worked, per part, by the file of each
    function (time spent waiting for events or locks left out)."""
    stats = pstats.Stats(str(profile))
    parts = dict.fromkeys([*PARTS, "other"], 0.0)
    for (filename, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if filename == "~" and any(word in name for word in IDLE):
            continue
        part = next((p for p, marks in PARTS.items() if any(m in filename for m in marks)), "other")
        parts[part] += tottime
    return parts


def serve_and_measure(
    models: int, seconds: float, period: float, profiled: bool
) -> tuple[dict[str, Any], dict[str, float]]:
    """One server, ``models`` models (0: start and stop only); the level's figures and,
    ``profiled``, the event loop's seconds per part (under cProfile, which slows the server: its
    figures are then not the level's)."""
    work = Path(tempfile.mkdtemp(prefix=f"ht-gateway-{models}-"))
    profile = work / "server.prof" if profiled else None
    srv = start_server(
        work,
        "--backend-option",
        "synthetic=true",
        "--max-resident-models",
        "0",
        "--max-pending",
        str(max(1024, 4 * models)),
        "--shutdown-timeout",
        "0",  # no parking at the end: only the profile is wanted
        profile=profile,
    )
    level: dict[str, Any] = {"models": models}

    def server_cpu() -> float | None:
        busy = busy_cpu_seconds(process_tree(srv.proc.pid))
        return busy[1] if busy else None

    try:
        if models:
            level = asyncio.run(run_level(srv.base_url, models, seconds, period, server_cpu))
    finally:
        # SIGINT: uvicorn stops and raises it again as KeyboardInterrupt, which cProfile's wrapper
        # lets pass through the `finally` that writes the profile (a re-raised SIGTERM would end
        # the process before that).
        srv.proc.send_signal(signal.SIGINT)
        srv.proc.wait(timeout=120)
    return level, breakdown(profile) if profile is not None and profile.exists() else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,100,1000", help="concurrent models, one run each")
    parser.add_argument("--seconds", type=float, default=20.0, help="of the saturated phase, per level")
    parser.add_argument("--period", type=float, default=20.0, help="seconds between a model's steps when paced")
    parser.add_argument("--profile-levels", default="1,100", help="levels run once more under cProfile")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    results: dict[str, Any] = {**result_header("gateway_scale", "cpu"), "period_s": args.period, "levels": []}
    rows = []
    profiled_levels = {int(x) for x in args.profile_levels.split(",") if x}
    _, startup = serve_and_measure(0, 0, args.period, profiled=True) if profiled_levels else ({}, {})
    for models in (int(x) for x in args.levels.split(",")):
        level, _ = serve_and_measure(models, args.seconds, args.period, profiled=False)
        if models in profiled_levels:
            _, parts = serve_and_measure(models, args.seconds, args.period, profiled=True)
            work = {part: max(0.0, spent - startup.get(part, 0.0)) for part, spent in parts.items()}
            if sum(work.values()) > 0:
                level["event_loop_share"] = {part: spent / sum(work.values()) for part, spent in work.items()}
        results["levels"].append(level)
        rows.append((f"{models} models", f"created in {level['create_s']:.1f} s"))
        for name in ("saturated", "paced"):
            phase = level[name]
            said = f"{phase['calls_per_s']:7.1f} calls/s  p50 {phase['p50_ms_all'] or 0:7.1f} ms"
            said += f"  p99 {phase['p99_ms_all'] or 0:7.1f} ms  errors {phase['errors']}"
            said += f"  CPU/call server {phase.get('server_cpu_ms_per_call', 0):.2f} ms"
            said += f" client {phase['client_cpu_ms_per_call']:.2f} ms"
            if name == "paced":
                said += f"  (offered {phase['offered_calls_per_s']:.1f} calls/s)"
            rows.append((f"  {name}", said))
        for part, share in level.get("event_loop_share", {}).items():
            rows.append((f"  event loop: {part}", f"{100 * share:5.1f} %"))
    print_table("gateway alone (synthetic backend) on this machine", rows)
    write_results(results, args.out, "cpu")


if __name__ == "__main__":
    main()
