"""What does streaming an answer cost the server per token, as the answer grows? The text a
streamed token adds (``OpenAIService.delta``, both OpenAI and Anthropic streams) against the
baseline of the whole answer decoded again at every token (``visible_text``, what ``delta`` did
before ``serving.detokenize``), in one run, with a stop string to look for.

    python benchmarks/streaming.py [--lengths 256 1024 4096]

Prints a table and writes benchmarks/results/streaming-cpu.json. Runs no model: a stream of the
built-in tiny model's tokenizer (byte-level BPE, as Qwen's and Llama 3's).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import print_table, result_header, write_results  # noqa: E402
from hosted_tinker.core.sampling import SampleSpec  # noqa: E402
from hosted_tinker.core.tiny_model import build_tokenizer  # noqa: E402
from hosted_tinker.server.serving.openai import OpenAIService, StreamedRow  # noqa: E402

TEXT = "The capital of France is Paris. Training a LoRA adapter is fast: naïve 中文 🙂 42. "


def stream(service: OpenAIService, tokens: list[int], spec: SampleSpec) -> float:
    """Seconds to stream ``tokens`` through ``delta``; checks the text is what the whole decode says."""
    row, sent = StreamedRow(), ""
    start = time.perf_counter()
    for token in tokens:
        sent += service.delta(row, token, spec)
    seconds = time.perf_counter() - start
    whole, _ = service.visible_text(tokens, spec)
    assert whole.startswith(sent) and len(whole) - len(sent) < 16, "the stream's text is not the answer's"
    return seconds


def whole_each_token(service: OpenAIService, tokens: list[int], spec: SampleSpec) -> float:
    """The baseline: the answer so far decoded whole and searched for stops at every token."""
    start = time.perf_counter()
    for i in range(1, len(tokens) + 1):
        service.visible_text(tokens[:i], spec)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    args = parser.parse_args()
    tok = build_tokenizer()
    service = object.__new__(OpenAIService)  # only its text methods run here: no engine behind it
    service.tokenizer = tok
    spec = SampleSpec(prompt=[], max_tokens=max(args.lengths), stop_strings=("<never>",))
    ids = tok.encode(TEXT * (1 + max(args.lengths) // 10))
    random.Random(0).shuffle(ids)  # any order: byte tokens split characters too
    rows, results = [], []
    for n in args.lengths:
        tokens = ids[:n]
        new = stream(service, tokens, spec)
        old = whole_each_token(service, tokens, spec)
        results.append({"tokens": n, "incremental_us_per_token": 1e6 * new / n, "whole_us_per_token": 1e6 * old / n})
        rows.append(
            (f"{n} tokens", f"{1e6 * new / n:8.1f} µs/token  vs whole decode {1e6 * old / n:9.1f}  ({old / new:6.1f}x)")
        )
    print_table("streamed text, per token (incremental vs whole decode at every token)", rows)
    write_results(
        {**result_header("streaming", "cpu"), "workload": {"tokenizer": "tiny byte-level BPE"}, "results": results},
        None,
        "cpu",
    )


if __name__ == "__main__":
    main()
