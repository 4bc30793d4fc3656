"""``benchmarks/load.py --scenario hostile``: what one key's attacks cost the other keys (issue
#38). Victims (a training client stepping, a sampling client asking for one token) run alone,
then beside each attack in turn, on one keyed server: their latencies (p50 / p99) and the peak
resident memory of the API process and of the worker, per phase, and each phase's ratio to the
victims alone, measured in the same run.

The attacks are the audit's, sent by one key: a custom loss that writes into another datum (made,
and its strongest allowed twin run in joint passes), a zstd bomb of 16.8 M empty datums, boolean
mask selections past a pass's bound, a sampler hog at the largest n x max_tokens allowed, 60
saves at once, a flood of keyless requests, eight concurrent large uploads.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from benchmarks.report import model_label, print_table, process_tree, result_header, setup, write_results
from tests.support.server import ALIAS, start_server

PHASES = ("alone", "custom_loss_writer", "zstd_bomb", "mask_selections", "sampler_hog", "save_race",
          "keyless_flood", "big_uploads")  # fmt: skip


def _key(data: Path, name: str, *limits: str) -> str:
    cmd = [sys.executable, "-m", "hosted_tinker", "keys", "create", "--data-dir", str(data), "--name", name]
    cmd += [f"--limit={limit}" for limit in limits]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


class Memory(threading.Thread):
    """The largest resident size of the API process and of its children (the worker), read from
    /proc four times a second, since the last ``reset``."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.stop = pid, threading.Event()
        self.api_kb = self.worker_kb = 0

    def reset(self) -> tuple[float, float]:
        peaks, self.api_kb, self.worker_kb = (self.api_kb / 1024, self.worker_kb / 1024), 0, 0
        return peaks

    def run(self) -> None:
        while not self.stop.wait(0.25):
            tree = process_tree(self.pid)
            self.api_kb = max(self.api_kb, _rss_kb(self.pid))
            self.worker_kb = max(self.worker_kb, sum(_rss_kb(p) for p in tree if p != self.pid))


def _rss_kb(pid: int) -> int:
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1])
    except (OSError, StopIteration, ValueError):
        return 0


class Victims:
    """Two victims of their own key, each in a loop until ``stop``: a LoRA step (forward_backward
    of 2 x 32 tokens, optim_step) and a one-token sample; latencies per phase."""

    def __init__(self, base_url: str, key: str) -> None:
        import tinker
        from tinker import types

        self.types, self.stop = types, threading.Event()
        self.service = tinker.ServiceClient(base_url=base_url, api_key=key)
        self.trainer = self.service.create_lora_training_client(base_model=ALIAS, rank=8).result()
        self.sampler = self.trainer.save_weights_and_get_sampling_client().result()
        rng = np.random.default_rng(0)
        self.data = []
        for _ in range(2):
            tokens = rng.integers(10, 500, 33).tolist()
            self.data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 32},
                )
            )
        self.times: dict[str, list[float]] = {"step": [], "sample": []}
        self.errors: list[str] = []

    def run(self) -> list[threading.Thread]:
        self.stop.clear()
        self.times = {"step": [], "sample": []}
        threads = [threading.Thread(target=self._loop, args=(kind,), daemon=True) for kind in self.times]
        for t in threads:
            t.start()
        return threads

    def _loop(self, kind: str) -> None:
        adam = self.types.AdamParams(learning_rate=1e-4)
        prompt = self.types.ModelInput.from_ints([11, 12, 13])
        one = self.types.SamplingParams(max_tokens=1)
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                if kind == "step":
                    self.trainer.forward_backward(self.data, "cross_entropy").result()
                    self.trainer.optim_step(adam).result()
                else:
                    self.sampler.sample(prompt, num_samples=1, sampling_params=one).result()
            except Exception as e:  # a victim must never fail: reported, the run fails
                self.errors.append(f"{kind}: {type(e).__name__}: {e}"[:300])
            self.times[kind].append(time.perf_counter() - started)


def _p(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q) * 1000) if xs else None


class Attacker:
    """The attacks, each a callable run in a loop on a few threads for a phase."""

    def __init__(self, base_url: str, key: str, phase_s: float) -> None:
        import tinker

        self.base_url, self.key, self.phase_s = base_url, key, phase_s
        self.http = httpx.Client(base_url=base_url, headers={"X-API-Key": key}, timeout=120)
        self.service = tinker.ServiceClient(base_url=base_url, api_key=key)
        self.trainer = self.service.create_lora_training_client(base_model=ALIAS, rank=8).result()
        self.model_id = self.trainer.get_info().model_id
        self.outcomes: dict[str, int] = {}
        self.answers: dict[str, str] = {}
        self._lock = threading.Lock()
        self._losses: dict[str, object] = {}
        header = pb.ForwardBackwardRequest(model_id=self.model_id, seq_id=1 << 30, loss_fn="cross_entropy")
        self.bomb = zstandard.ZstdCompressor(level=19).compress(header.SerializeToString() + b"\x1a\x00" * 16_800_000)
        self.upload = b"\x0a" * (120 << 20)

    def count(self, what: str, response: httpx.Response | None = None) -> None:
        """One more ``what``; the first answer of each kind is kept (its start) for the report."""
        with self._lock:
            self.outcomes[what] = self.outcomes.get(what, 0) + 1
            if response is not None and what not in self.answers:
                self.answers[what] = response.text[:300]

    def loss(self, fn: Callable, ranks: dict[str, int]):
        """The attacker's loss made from ``fn``, once (the SDK refuses to make one twice)."""
        with self._lock:
            if fn.__name__ not in self._losses:
                self._losses[fn.__name__] = self.service.create_custom_loss(fn, input_ranks=ranks).result()
            return self._losses[fn.__name__]

    def custom_loss_writer(self) -> None:
        from tests.support.custom_losses import DATA, evil_writer, views_everywhere

        try:
            self.loss(evil_writer, {"logprobs": 1})
            self.count("writer accepted")
        except Exception:
            self.count("writer refused")
        loss = self.loss(views_everywhere, {"logprobs": 1, "weights": 1})
        self.trainer.forward_backward_custom(DATA, loss).result()
        self.count("views loss run")

    def zstd_bomb(self) -> None:
        r = self.http.post(
            "/api/v1/forward_backward",
            content=self.bomb,
            headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"},
        )
        self.count(f"bomb {r.status_code}", r)

    def mask_selections(self) -> None:
        from tinker import types

        from tests.support.custom_losses import masked_copies

        datum = types.Datum(
            model_input=types.ModelInput.from_ints([7] * 4096), loss_fn_inputs={"target_tokens": [8] * 4096}
        )
        try:
            self.trainer.forward_backward_custom([datum], self.loss(masked_copies, {"logprobs": 1})).result()
            self.count("mask loss ran")
        except Exception:
            self.count("mask loss refused")

    def sampler_hog(self) -> None:
        # n * (prompt + max_tokens) at --max-sample-tokens' default, 65,536
        body = {"model": ALIAS, "prompt": [11, 12, 13], "n": 128, "max_tokens": 509, "stop": [], "temperature": 1}
        try:  # the largest n x max_tokens allowed; cut off at the phase's end (the server drops it then)
            r = self.http.post("/v1/completions", json=body, timeout=self.phase_s)
            self.count(f"hog {r.status_code}", r)
        except httpx.TimeoutException:
            self.count("hog still running at the phase's end")

    def save_race(self) -> None:
        futures = [self.trainer.save_weights_for_sampler(f"race-{time.monotonic_ns()}-{i}") for i in range(60)]
        for f in futures:
            try:
                f.result()
                self.count("save stored")
            except Exception:
                self.count("save refused")

    def keyless_flood(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=30) as anon:
            for _ in range(200):
                self.count(f"keyless {anon.get('/api/v1/no-such-route').status_code}")

    def big_uploads(self) -> None:
        headers = {"Content-Type": "application/x-protobuf"}
        r = self.http.post("/api/v1/forward_backward", content=self.upload, headers=headers)
        self.count(f"upload {r.status_code}", r)


def run_hostile(args: argparse.Namespace) -> int:
    work, model, _ = setup(args.model)
    keys = {"victim": _key(work, "victim"), "attacker": _key(work, "attacker", "checkpoint_bytes=200000")}
    server = start_server(work, "--model", model, "--device", args.device)
    memory = Memory(server.proc.pid)
    memory.start()
    phases: dict[str, dict] = {}
    try:
        victims = Victims(server.base_url, keys["victim"])
        attacker = Attacker(server.base_url, keys["attacker"], args.phase_s)
        threads = {"big_uploads": 8, "save_race": 1, "sampler_hog": 2}
        for phase in PHASES:
            memory.reset()
            attack: Callable[[], None] | None = getattr(attacker, phase, None)
            stop_attack = threading.Event()
            running = victims.run()
            with ThreadPoolExecutor(threads.get(phase, 2)) as pool:
                if attack is not None:
                    for _ in range(threads.get(phase, 2)):
                        pool.submit(_repeat, attack, stop_attack, attacker)
                time.sleep(args.phase_s)
                stop_attack.set()
                victims.stop.set()
            for t in running:
                t.join(timeout=300)
            api_mb, worker_mb = memory.reset()
            phases[phase] = {
                "step_p50_ms": _p(victims.times["step"], 50),
                "step_p99_ms": _p(victims.times["step"], 99),
                "sample_p50_ms": _p(victims.times["sample"], 50),
                "sample_p99_ms": _p(victims.times["sample"], 99),
                "steps": len(victims.times["step"]),
                "samples": len(victims.times["sample"]),
                "api_peak_rss_mb": api_mb,
                "worker_peak_rss_mb": worker_mb,
                "server_alive": server.proc.poll() is None,
            }
    finally:
        memory.stop.set()
        server.stop()
    alone = phases["alone"]
    for row in phases.values():
        for k in ("step_p99_ms", "sample_p99_ms", "api_peak_rss_mb", "worker_peak_rss_mb"):
            row[f"{k}_vs_alone"] = row[k] / alone[k] if row[k] and alone[k] else None
    passed = not victims.errors and all(row["server_alive"] for row in phases.values())
    results = {
        **result_header("hostile", args.device),
        "workload": {"model": model_label(args.model), "phase_s": args.phase_s, "phases": list(PHASES)},
        "passed": passed,
        "victim_errors": victims.errors[:20],
        "attack_outcomes": attacker.outcomes,
        "first_answers": attacker.answers,
        "phases": phases,
    }
    rows = [
        (
            phase,
            f"step p99 {row['step_p99_ms'] or 0:7.0f} ms ({row['step_p99_ms_vs_alone'] or 0:4.2f}x)  "
            f"sample p99 {row['sample_p99_ms'] or 0:7.0f} ms ({row['sample_p99_ms_vs_alone'] or 0:4.2f}x)  "
            f"API {row['api_peak_rss_mb']:6.0f} MB  worker {row['worker_peak_rss_mb']:6.0f} MB",
        )
        for phase, row in phases.items()
    ]
    print_table(f"hostile: victims alone, then beside each attack ({args.phase_s:.0f} s each)", rows)
    print(f"  attack outcomes: {attacker.outcomes}")
    write_results(results, args.out, args.device)
    return 0 if passed else 1


def _repeat(attack: Callable[[], None], stop: threading.Event, attacker: Attacker) -> None:
    while not stop.is_set():
        try:
            attack()
        except Exception as e:
            attacker.count(f"{attack.__name__} raised {type(e).__name__}")
