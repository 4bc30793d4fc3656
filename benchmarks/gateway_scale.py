"""How many tenants can one gateway serve? The server runs with the benchmark-only
``synthetic`` backend option (forward_backward answers correctly shaped log-probs at once,
without running the model), so that what is measured is the gateway alone: HTTP, the codec,
sessions, seq_id ordering, futures and their store writes, the dispatch thread, the worker pipe.

For 1, 100 and 1,000 concurrent models (one SDK ServiceClient, async calls), each model runs
``forward_backward`` (one datum of 64 tokens) then ``optim_step``, again and again, for
``--seconds``; reported per level: SDK training calls per second, p50/p99 submit→result latency
of each call, errors, and the server's CPU time per call (all its processes, from /proc); then
the same level again under cProfile for where the event loop's work goes (HTTP stack, codec,
scheduler, store, the rest: shares of its busy time, start-up subtracted).

    python benchmarks/gateway_scale.py [--levels 1,100,1000 --seconds 20]

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
from tests.conftest import ALIAS, start_server  # noqa: E402

# Where the event loop's CPU goes, by the file a function lives in (first match wins).
PARTS = {
    "http": ("uvicorn", "h11", "httptools", "starlette", "fastapi", "anyio", "/asyncio/"),
    "codec": ("hosted_tinker/server/protocol", "google/protobuf", "zstandard", "pydantic"),
    "scheduler": ("hosted_tinker/server/scheduler.py", "hosted_tinker/server/serving/joint_passes.py"),
    "store": ("hosted_tinker/server/store.py", "sqlite3", "hosted_tinker/server/schema.py"),
}


def datum(types, k: int):
    tokens = [(k * 7 + i) % 400 + 10 for i in range(65)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 64},
    )


async def run_level(base_url: str, models: int, seconds: float) -> dict[str, Any]:
    import tinker
    from tinker import types

    latencies: dict[str, list[float]] = {"forward_backward": [], "optim_step": []}
    errors: list[str] = []
    adam = types.AdamParams(learning_rate=1e-4)
    with tinker.ServiceClient(base_url=base_url) as sc:
        clients = await asyncio.gather(
            *(sc.create_lora_training_client(base_model=ALIAS, rank=4) for _ in range(models))
        )
        stop_at = time.monotonic() + seconds

        async def timed(kind: str, submit) -> None:
            """One call, submitted (the SDK's APIFuture comes back at once) and awaited."""
            start = time.perf_counter()
            try:
                await submit()
            except Exception as e:  # every error is reported, none stops the run
                errors.append(f"{kind}: {type(e).__name__}: {e}")
                return
            latencies[kind].append(time.perf_counter() - start)

        async def loop(i: int, tc) -> None:
            k = 0
            while time.monotonic() < stop_at:
                data = [datum(types, i + k)]
                await timed("forward_backward", lambda data=data: tc.forward_backward(data, "cross_entropy"))
                await timed("optim_step", lambda: tc.optim_step(adam))
                k += 1

        started = time.monotonic()
        await asyncio.gather(*(loop(i, tc) for i, tc in enumerate(clients)))
        elapsed = time.monotonic() - started
    every = [x for xs in latencies.values() for x in xs]
    return {
        "models": models,
        "calls": len(every),
        "calls_per_s": len(every) / elapsed,
        "latency_ms": {
            kind: {q: 1000 * float(np.percentile(xs, p)) for q, p in (("p50", 50), ("p99", 99))}
            for kind, xs in latencies.items()
            if xs
        },
        "p99_ms_all": 1000 * float(np.percentile(every, 99)) if every else None,
        "errors": len(errors),
        "first_errors": errors[:5],
    }


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


def serve_and_measure(models: int, seconds: float, profiled: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """One server, ``models`` models for ``seconds`` (0 models: start and stop only); the level's
    figures and, ``profiled``, the event loop's seconds per part (under cProfile, which slows the
    server: its calls/s and CPU are then not the level's)."""
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
    level: dict[str, Any] = {"models": models, "calls": 0}
    try:
        before = busy_cpu_seconds(process_tree(srv.proc.pid))
        if models:
            level = asyncio.run(run_level(srv.base_url, models, seconds))
        after = busy_cpu_seconds(process_tree(srv.proc.pid))
    finally:
        # SIGINT: uvicorn stops and raises it again as KeyboardInterrupt, which cProfile's wrapper
        # lets pass through the `finally` that writes the profile (a re-raised SIGTERM would end
        # the process before that).
        srv.proc.send_signal(signal.SIGINT)
        srv.proc.wait(timeout=120)
    if before and after and level["calls"]:
        level["server_cpu_ms_per_call"] = 1000 * (after[1] - before[1]) / level["calls"]
    return level, breakdown(profile) if profile is not None and profile.exists() else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,100,1000", help="concurrent models, one run each")
    parser.add_argument("--seconds", type=float, default=20.0, help="per level")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    results: dict[str, Any] = {**result_header("gateway_scale", "cpu"), "levels": []}
    rows = []
    _, startup = serve_and_measure(0, 0, profiled=True)  # what starting and stopping costs the event loop
    for models in (int(x) for x in args.levels.split(",")):
        level, _ = serve_and_measure(models, args.seconds, profiled=False)
        profiled, parts = serve_and_measure(models, args.seconds, profiled=True)
        work = {part: max(0.0, spent - startup.get(part, 0.0)) for part, spent in parts.items()}
        if sum(work.values()) > 0:
            level["event_loop_share"] = {part: spent / sum(work.values()) for part, spent in work.items()}
        results["levels"].append(level)
        said = f"{level['calls_per_s']:8.1f} calls/s   p99 {level['p99_ms_all']:8.1f} ms   errors {level['errors']}"
        if "server_cpu_ms_per_call" in level:
            said += f"   server {level['server_cpu_ms_per_call']:.2f} ms CPU/call"
        rows.append((f"{models} models", said))
        for part, share in level.get("event_loop_share", {}).items():
            rows.append((f"  event loop: {part}", f"{100 * share:5.1f} %"))
    print_table("gateway alone (synthetic backend) on this machine", rows)
    write_results(results, args.out, "cpu")


if __name__ == "__main__":
    main()
