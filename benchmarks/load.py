"""Issue #6's load test: 32 concurrent tinker SDK training clients x 10 steps (LoRA,
forward_backward + optim_step) and 64 concurrent sampling requests, at the same time, against one
server on the tiny model whose queue bounds are set low enough that the load reaches them.

Passes when no SDK call raised and ``/healthz`` (polled every 50 ms in the background) never
showed more pending requests than the server's ``--max-pending``. Refused submits (429 +
Retry-After) are expected: the SDK sends them again, and the server's count of them is reported.

    python benchmarks/load.py [--trainers 32 --steps 10 --samplers 64 --max-pending 48
                               --max-pending-per-model 16 --model DIR --device cpu]
    python benchmarks/load.py --scenario hostile [--phase-s 20]   (benchmarks/hostile.py)

Prints a table, writes benchmarks/results/load-<device>.json and exits 1 on any error or on an
exceeded bound.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import as_completed
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

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

# ---- what the clients see -------------------------------------------------------------------


@dataclass
class Record:
    """Latencies per call kind and every exception, filled in from many threads."""

    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: list[dict[str, str]] = field(default_factory=list)
    losses: dict[int, list[float]] = field(default_factory=dict)  # trainer -> mean loss per step
    ends: dict[str, float] = field(default_factory=dict)  # "training"/"sampling" -> last client's end
    lock: threading.Lock = field(default_factory=threading.Lock)

    def time(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.latencies.setdefault(kind, []).append(seconds)

    def finished(self, kind: str) -> None:
        with self.lock:
            self.ends[kind] = max(self.ends.get(kind, 0.0), time.perf_counter())

    def error(self, where: str, exc: BaseException | str) -> None:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        with self.lock:
            self.errors.append({"where": where, "error": text[:500]})


class Deadline:
    """One wall-clock budget for the whole run, so that a stuck server fails the run instead of
    hanging it (the SDK retries a dead server for ~5 minutes per call)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.1, self.end - time.monotonic())


def make_data(types, batch: int, seq_len: int, vocab: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(batch):
        s = rng.integers(10, vocab - 1, seq_len + 1).tolist()
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(s[:-1]),
                loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * seq_len},
            )
        )
    return data


def connect(
    where: str,
    call: str,
    make: Callable[[Any], Any],
    base_url: str,
    start: threading.Barrier,
    rec: Record,
    dl: Deadline,
) -> tuple[Any, Any] | None:
    """A ServiceClient and the client ``make`` asks it for (timed as ``call``), once every other
    client exists too (``start``); None, with the failure recorded, if either went wrong."""
    import tinker

    service = client = None
    try:
        t0 = time.perf_counter()
        service = tinker.ServiceClient(base_url=base_url)
        client = make(service).result(timeout=dl.left())
        rec.time(call, time.perf_counter() - t0)
    except Exception as e:
        rec.error(f"{where}: create", e)
    try:
        start.wait(timeout=dl.left())
    except threading.BrokenBarrierError as e:
        rec.error(f"{where}: start barrier", e)
        return None
    return None if client is None else (service, client)


def trainer(
    index: int, args: argparse.Namespace, base_url: str, vocab: int, start: threading.Barrier, rec: Record, dl: Deadline
) -> None:
    """One user: its own ServiceClient and LoRA training client, then ``steps`` steps, each
    forward_backward and optim_step submitted back to back (the SDK pipelines them)."""
    from tinker import types

    where = f"trainer {index}"

    def make(service: Any) -> Any:
        return service.create_lora_training_client(base_model=ALIAS, rank=args.rank, seed=index)

    if (connected := connect(where, "create_lora_training_client", make, base_url, start, rec, dl)) is None:
        return
    service, client = connected
    data = make_data(types, args.batch, args.seq_len, vocab, seed=index)
    adam = types.AdamParams(learning_rate=args.lr)
    losses = []
    for step in range(args.steps):
        try:
            t_fb = time.perf_counter()
            fb = client.forward_backward(data, "cross_entropy")
            t_op = time.perf_counter()
            op = client.optim_step(adam)
            result = fb.result(timeout=dl.left())
            rec.time("forward_backward", time.perf_counter() - t_fb)
            op.result(timeout=dl.left())
            rec.time("optim_step", time.perf_counter() - t_op)
            loss = result.metrics["loss:sum"] / (args.batch * args.seq_len)
            if not math.isfinite(loss):
                rec.error(f"{where}: step {step}", f"loss is {loss}")
            losses.append(loss)
        except Exception as e:
            rec.error(f"{where}: step {step}", e)
    rec.finished("training")
    with rec.lock:
        rec.losses[index] = losses
    try:
        service.close("success").result(timeout=dl.left())
    except Exception as e:
        rec.error(f"{where}: close", e)


def sampler_group(
    index: int,
    n_requests: int,
    args: argparse.Namespace,
    base_url: str,
    vocab: int,
    start: threading.Barrier,
    rec: Record,
    dl: Deadline,
) -> None:
    """One SamplingClient on the base model (its own ServiceClient) that sends ``n_requests``
    sample calls at once, then waits on all of them; each call is timed from submit to result."""
    from tinker import types

    where = f"sampler {index}"

    def make(service: Any) -> Any:
        return service.create_sampling_client(base_model=ALIAS)

    if (connected := connect(where, "create_sampling_client", make, base_url, start, rec, dl)) is None:
        return
    service, client = connected
    rng = np.random.default_rng(1000 + index)
    submitted: dict[Any, float] = {}
    for i in range(n_requests):
        prompt = types.ModelInput.from_ints(rng.integers(10, vocab - 1, args.prompt_len).tolist())
        params = types.SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=i, stop=[])  # no EOS
        try:
            submitted[client.sample(prompt, num_samples=1, sampling_params=params).future()] = time.perf_counter()
        except Exception as e:
            rec.error(f"{where}: submit {i}", e)
    try:
        for future in as_completed(submitted, timeout=dl.left()):
            done = time.perf_counter()
            try:
                made = [len(s.tokens) for s in future.result().sequences]
                rec.time("sample", done - submitted[future])
                if made != [args.new_tokens]:
                    rec.error(f"{where}: sample", f"made {made} tokens, expected [{args.new_tokens}]")
            except Exception as e:
                rec.error(f"{where}: sample", e)
    except TimeoutError as e:
        rec.error(f"{where}: samples still running at the deadline", e)
    rec.finished("sampling")
    try:
        service.close("success").result(timeout=dl.left())
    except Exception as e:
        rec.error(f"{where}: close", e)


# ---- what the server shows ------------------------------------------------------------------


def memory_kb(pid: int, field_name: str) -> int:
    """``VmRSS`` or ``VmHWM`` (peak RSS) of one process in kB, from /proc; 0 where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


class HealthPoller(threading.Thread):
    """Polls ``/healthz`` every ``interval`` s: the largest ``queue.pending`` and ``in_flight`` seen,
    the 429 count, and the server's RSS (its whole process tree, summed)."""

    def __init__(self, base_url: str, server_pid: int, interval: float = 0.05) -> None:
        super().__init__(daemon=True, name="healthz-poller")
        self.http = httpx.Client(base_url=base_url, timeout=5.0)
        self.server_pid = server_pid
        self.interval = interval
        self.stop_event = threading.Event()
        self.polls = 0
        self.poll_errors: list[str] = []
        self.max_pending = 0
        self.max_pending_one_model = 0
        self.max_in_flight = 0
        self.polls_at_bound = 0
        self.max_pending_bound: int | None = None
        self.max_pending_per_model_bound: int | None = None
        self.refused_first: int | None = None
        self.refused_last: int | None = None
        self.max_tree_rss_kb = 0
        self.pids_seen: set[int] = set()
        self.latencies: list[float] = []

    def poll(self) -> dict:
        t0 = time.perf_counter()
        queue = self.http.get("/healthz").raise_for_status().json()["queue"]
        self.latencies.append(time.perf_counter() - t0)
        return queue

    def run(self) -> None:
        next_rss = 0.0
        while not self.stop_event.is_set():
            t0 = time.monotonic()
            try:
                queue = self.poll()
                self.polls += 1
                self.max_pending = max(self.max_pending, queue["pending"])
                self.max_pending_one_model = max(self.max_pending_one_model, queue["pending_busiest_model"])
                self.max_in_flight = max(self.max_in_flight, queue.get("in_flight", 0))
                self.max_pending_bound = queue["max_pending"]
                self.max_pending_per_model_bound = queue.get("max_pending_per_model")
                self.polls_at_bound += queue["pending"] >= queue["max_pending"]
                if self.refused_first is None:
                    self.refused_first = queue["refused"]
                self.refused_last = queue["refused"]
            except Exception as e:
                self.poll_errors.append(f"{type(e).__name__}: {e}"[:300])
            if t0 >= next_rss:  # the process tree scan costs more than a poll: 4 times a second
                tree = process_tree(self.server_pid)
                self.pids_seen.update(tree)
                self.max_tree_rss_kb = max(self.max_tree_rss_kb, sum(memory_kb(p, "VmRSS") for p in tree))
                next_rss = t0 + 0.25
            self.stop_event.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def finish(self, drain_s: float = 10.0) -> None:
        self.stop_event.set()
        self.join(timeout=10)
        # A last look once every client is done: the queue should drain to 0 (closing a session
        # may still be unloading its model). Anything left after `drain_s` would be a leak.
        self.final_pending: int | None = None
        self.drained_after_s: float | None = None
        t0 = time.monotonic()
        while True:
            try:
                queue = self.poll()
                self.refused_last = queue["refused"]
                self.final_pending = queue["pending"]
            except Exception as e:
                self.poll_errors.append(f"final: {type(e).__name__}: {e}"[:300])
            if self.final_pending == 0:
                self.drained_after_s = time.monotonic() - t0
                break
            if time.monotonic() - t0 > drain_s:
                break
            time.sleep(0.1)
        self.http.close()

    def peak_rss_mb(self) -> dict[str, float | None]:
        """The largest summed RSS seen while polling, and each process's own peak (VmHWM)."""
        hwm = {pid: memory_kb(pid, "VmHWM") for pid in sorted(self.pids_seen)}
        return {
            "tree_rss_max_while_polling_mb": self.max_tree_rss_kb / 1024 or None,
            "server_process_vmhwm_mb": hwm.get(self.server_pid, 0) / 1024 or None,
            "per_process_vmhwm_mb": {str(pid): kb / 1024 for pid, kb in hwm.items() if kb},
        }


# ---- the run ---------------------------------------------------------------------------------


def percentiles(xs: list[float]) -> dict[str, float | int | None]:
    if not xs:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "n": len(xs),
        "p50_ms": 1000 * float(np.percentile(xs, 50)),
        "p99_ms": 1000 * float(np.percentile(xs, 99)),
        "max_ms": 1000 * max(xs),
    }


def split(total: int, parts: int) -> list[int]:
    """``total`` requests over ``parts`` clients, as evenly as possible."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def run_load(
    args: argparse.Namespace, base_url: str, vocab: int, server_pid: int, dl: Deadline
) -> tuple[Record, dict[str, float | None]]:
    rec = Record()
    groups = [n for n in split(args.samplers, args.sampling_clients) if n > 0]
    start = threading.Barrier(args.trainers + len(groups) + 1)  # + this thread, which starts the clock
    threads = [
        threading.Thread(target=trainer, args=(i, args, base_url, vocab, start, rec, dl), daemon=True)
        for i in range(args.trainers)
    ]
    threads += [
        threading.Thread(target=sampler_group, args=(i, n, args, base_url, vocab, start, rec, dl), daemon=True)
        for i, n in enumerate(groups)
    ]
    t_setup = time.perf_counter()
    for t in threads:
        t.start()
    try:
        start.wait(timeout=dl.left())  # every client created (or failed to be)
    except threading.BrokenBarrierError as e:
        rec.error("start barrier", e)
    t0 = time.perf_counter()
    pids = [os.getpid(), *process_tree(server_pid)]  # this process and the server with its workers
    cpu_before = busy_cpu_seconds(pids)
    for t in threads:
        t.join(timeout=dl.left())
        if t.is_alive():
            rec.error(t.name, "still running at the deadline")
    # Each client's work ends before its ServiceClient.close(): the walls end at the last one's.
    end = max(rec.ends.values(), default=time.perf_counter())
    cpu_after = busy_cpu_seconds(pids)
    times: dict[str, float | None] = {
        "client_setup_s": t0 - t_setup,
        "wall_s": end - t0,
        "training_wall_s": rec.ends.get("training", t0) - t0,
        "sampling_wall_s": rec.ends.get("sampling", t0) - t0,
        # CPU that neither this process nor the server used meanwhile: other load on the machine.
        "other_processes_cpu_s": None,
        "run_cpu_s": None,
    }
    if cpu_before is not None and cpu_after is not None:
        times["run_cpu_s"] = cpu_after[1] - cpu_before[1]
        times["other_processes_cpu_s"] = (cpu_after[0] - cpu_before[0]) - times["run_cpu_s"]
    return rec, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", type=int, default=32, help="concurrent training clients")
    parser.add_argument("--steps", type=int, default=10, help="forward_backward + optim_step per trainer")
    parser.add_argument("--samplers", type=int, default=64, help="concurrent sampling requests")
    parser.add_argument("--sampling-clients", type=int, default=2, help="SamplingClients sharing those requests")
    parser.add_argument("--batch", type=int, default=2, help="sequences per forward_backward")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--max-pending", type=int, default=48, help="server's global queue bound")
    parser.add_argument("--max-pending-per-model", type=int, default=16, help="server's per-model/sampler bound")
    parser.add_argument("--poll-interval", type=float, default=0.05, help="/healthz polling period (s)")
    parser.add_argument("--timeout", type=float, default=900, help="fail the run after this many seconds")
    parser.add_argument(
        "--scenario", choices=["load", "hostile"], default="load", help="hostile: benchmarks/hostile.py"
    )
    parser.add_argument("--phase-s", type=float, default=20.0, help="hostile: seconds of each attack")
    add_common_args(parser)
    args = parser.parse_args()
    if args.scenario == "hostile":
        from benchmarks.hostile import run_hostile

        sys.exit(run_hostile(args))
    began = time.perf_counter()

    work, model, vocab = setup(args.model)
    server = start_server(
        work,
        "--model",
        model,
        "--device",
        args.device,
        "--max-pending",
        str(args.max_pending),
        "--max-pending-per-model",
        str(args.max_pending_per_model),
    )
    try:
        poller = HealthPoller(server.base_url, server.proc.pid, args.poll_interval)
        poller.start()
        rec, times = run_load(args, server.base_url, vocab, server.proc.pid, Deadline(args.timeout))
        poller.finish()
        server_alive = server.proc.poll() is None
        memory = poller.peak_rss_mb()
    finally:
        server.stop()
    log_tail = server.log_path.read_text(errors="replace")[-3000:]

    refused = (
        poller.refused_last - (poller.refused_first or 0)
        if poller.refused_last is not None and poller.refused_first is not None
        else None
    )
    if not server_alive:
        rec.error("server", f"exited with {server.proc.returncode} during the run")
    bound_ok = (
        poller.polls > 0
        and poller.max_pending <= args.max_pending
        and poller.max_pending_one_model <= args.max_pending_per_model
    )
    steps_done = len(rec.latencies.get("optim_step", []))
    samples_done = len(rec.latencies.get("sample", []))
    improved = sum(1 for ls in rec.losses.values() if len(ls) >= 2 and ls[-1] < ls[0])
    results = {
        **result_header("load", args.device),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "workload": {
            "trainers": args.trainers,
            "steps_per_trainer": args.steps,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "lora_rank": args.rank,
            "sampling_requests": args.samplers,
            "sampling_clients": args.sampling_clients,
            "prompt_tokens": args.prompt_len,
            "new_tokens_per_sample": args.new_tokens,
            "model": model_label(args.model),
            "clients": "one tinker ServiceClient per trainer and per sampling client, all in this process, "
            "each driven by its own thread; clients are created concurrently, then start together",
        },
        "server_bounds": {
            "max_pending": args.max_pending,
            "max_pending_per_model": args.max_pending_per_model,
            "reported_by_healthz": {
                "max_pending": poller.max_pending_bound,
                "max_pending_per_model": poller.max_pending_per_model_bound,
            },
        },
        "passed": not rec.errors and bound_ok,
        "errors": len(rec.errors),
        "error_details": rec.errors[:50],
        "queue_bound_respected": bound_ok,
        "queue": {
            "max_pending_seen": poller.max_pending,
            "max_in_flight_seen": poller.max_in_flight,
            "max_pending_per_model_seen": poller.max_pending_one_model,
            "polls": poller.polls,
            "polls_at_global_bound": poller.polls_at_bound,
            "poll_errors": len(poller.poll_errors),
            "poll_error_details": poller.poll_errors[:10],
            "healthz_latency": percentiles(poller.latencies),
            "refused_429": refused,
            "pending_after_run": poller.final_pending,
            "pending_drained_to_0_after_s": poller.drained_after_s,
        },
        "latency": {kind: percentiles(xs) for kind, xs in sorted(rec.latencies.items())},
        "wall_s": times["wall_s"],
        "training_wall_s": times["training_wall_s"],
        "sampling_wall_s": times["sampling_wall_s"],
        "client_setup_s": times["client_setup_s"],
        "cpu_s_benchmark_and_server": times["run_cpu_s"],
        "cpu_s_other_processes": times["other_processes_cpu_s"],
        "steps_completed": steps_done,
        "samples_completed": samples_done,
        "steps_per_s": steps_done / times["training_wall_s"] if times["training_wall_s"] > 0 else None,
        "samples_per_s": samples_done / times["sampling_wall_s"] if times["sampling_wall_s"] > 0 else None,
        "sampled_tokens_per_s": samples_done * args.new_tokens / times["sampling_wall_s"]
        if times["sampling_wall_s"] > 0
        else None,
        "trainers_whose_loss_fell": improved,
        "server_memory": memory,
        "benchmark_runtime_s": time.perf_counter() - began,
        "notes": [
            "Latencies are submit-to-result as the SDK caller sees them, 429 retries included; "
            "optim_step is submitted right after forward_backward, so its time includes waiting for it.",
            "wall_s runs from the moment every client exists to the last thread's end; steps_per_s counts "
            "completed forward_backward + optim_step pairs over training_wall_s, samples_per_s over "
            "sampling_wall_s (both from the same start).",
            "refused_429 is the change in /healthz queue.refused over the run (both bounds together).",
            "queue_bound_respected: the largest queue.pending seen in /healthz, polled every "
            f"{args.poll_interval * 1000:.0f} ms, is <= max_pending. /healthz does not show per-model counts.",
            "server_memory: the server's process tree (children included), RSS summed at each poll "
            "(4/s), and each process's VmHWM at the end.",
            "cpu_s_other_processes: CPU time used on the machine by anything but this process and the "
            "server's process tree during the run; with 2 cores, a large value means the latencies are "
            "not representative.",
        ],
    }

    lat = results["latency"]

    def lat_row(kind: str) -> str:
        x = lat.get(kind, percentiles([]))
        if not x["n"]:
            return "none completed"
        return f"{x['p50_ms']:8.1f} / {x['p99_ms']:8.1f} / {x['max_ms']:8.1f} ms  (n={x['n']})"

    rss = memory["tree_rss_max_while_polling_mb"]
    rows = [
        ("result", "PASS" if results["passed"] else "FAIL"),
        ("errors (any exception)", str(len(rec.errors))),
        (
            "queue bound respected",
            f"{bound_ok}: max pending seen {poller.max_pending} <= {args.max_pending}, "
            f"one model {poller.max_pending_one_model} <= {args.max_pending_per_model} "
            f"({poller.polls} polls, {poller.polls_at_bound} at the bound)",
        ),
        ("429 refusals (server count)", str(refused)),
        (
            "queue after the run",
            f"drained to 0 in {poller.drained_after_s:.2f} s"
            if poller.drained_after_s is not None
            else f"still {poller.final_pending} pending 10 s after the last client finished",
        ),
        ("forward_backward p50 / p99 / max", lat_row("forward_backward")),
        ("optim_step p50 / p99 / max", lat_row("optim_step")),
        ("sample p50 / p99 / max", lat_row("sample")),
        ("create_lora_training_client p50/p99/max", lat_row("create_lora_training_client")),
        ("wall (all clients created -> all done)", f"{times['wall_s']:.1f} s"),
        (
            "training throughput",
            f"{results['steps_per_s'] or 0:.2f} steps/s ({steps_done} steps in {times['training_wall_s']:.1f} s)",
        ),
        (
            "sampling throughput",
            f"{results['samples_per_s'] or 0:.2f} samples/s ({samples_done} in {times['sampling_wall_s']:.1f} s)",
        ),
        ("trainers whose loss fell", f"{improved} / {args.trainers}"),
        ("server peak RSS (process tree)", f"{rss:.0f} MB" if rss else "n/a"),
        ("benchmark runtime", f"{results['benchmark_runtime_s']:.1f} s"),
        (
            "other processes' CPU during the run",
            "n/a"
            if times["other_processes_cpu_s"] is None
            else f"{times['other_processes_cpu_s']:.1f} s (benchmark + server: {times['run_cpu_s']:.1f} s, "
            f"of {times['wall_s'] * (os.cpu_count() or 1):.0f} core-s)",
        ),
    ]
    print_table(
        f"load on {results['device']}: {args.trainers} trainers x {args.steps} steps "
        f"(batch {args.batch} x {args.seq_len}), {args.samplers} samples x {args.new_tokens} tokens, "
        f"bounds {args.max_pending} global / {args.max_pending_per_model} per model",
        rows,
    )
    for err in rec.errors[:10]:
        print(f"  error: {err['where']}: {err['error']}")
    if rec.errors and not server_alive:
        print(f"server log tail:\n{log_tail}")
    write_results(results, args.out, args.device)
    sys.exit(0 if results["passed"] else 1)


if __name__ == "__main__":
    main()
