"""What every benchmark in this folder shares: its model/device/output options, the model it runs
on, and how it reports (a console table and a JSON file under benchmarks/results/).

Kept in one place so that the result files of different benchmarks describe the machine and the
model the same way and can be compared side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

from hosted_tinker.core.tiny_model import build_tiny_model

# Every benchmark imports this module first, before tinker or transformers: run offline, quietly.
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TINKER_API_KEY", "tml-bench")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TINY_MODEL_LABEL = "built-in tiny Qwen3 (0.46M params)"


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--device`` and ``--out``: the options :func:`setup` and :func:`write_results` read."""
    parser.add_argument("--model", default=None, help="model dir (default: the built-in tiny model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)


def setup(model_arg: str | None) -> tuple[Path, str, int]:
    """A fresh work dir, the model to run (``model_arg`` or the tiny model built there) and its vocab size."""
    from transformers import AutoConfig

    work = Path(tempfile.mkdtemp(prefix="ht-bench-"))
    model = model_arg or str(build_tiny_model(work / "models" / "tiny-qwen3"))
    return work, model, AutoConfig.from_pretrained(model).vocab_size


def model_label(model_arg: str | None) -> str:
    """The ``workload.model`` field: the model dir as given, or a description of the tiny model."""
    return TINY_MODEL_LABEL if model_arg is None else model_arg


def result_header(benchmark: str, device: str) -> dict[str, Any]:
    """The fields every result file starts with: which benchmark, on what hardware, with which torch."""
    import torch

    return {"benchmark": benchmark, "device": device_name(device), "torch": torch.__version__}


def device_name(device: str) -> str:
    """The ``device`` field: the GPU's name, or the CPU's core count and architecture."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name()
    return f"cpu ({os.cpu_count()} cores, {platform.machine()})"


def record_failure(failed: dict[str, str], name: str, error: BaseException) -> None:
    """A benchmark path that failed (out of memory, say): into ``failed`` and onto stderr; the
    other paths still run, and the result file says which failed and why."""
    failed[name] = f"{type(error).__name__}: {error}"[:2000]
    print(f"{name} failed: {failed[name][:500]}", file=sys.stderr)


def print_table(title: str, rows: list[tuple[str, str]], width: int | None = None) -> None:
    """Print ``title`` after a blank line, then one indented ``name  value`` line per row, names aligned."""
    width = width if width is not None else max((len(name) for name, _ in rows), default=0)
    print(f"\n{title}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def write_results(results: dict[str, Any], out: str | None, device: str) -> Path:
    """Write ``results`` to ``out``, by default ``results/<benchmark>-<device kind>.json``, and say where."""
    path = Path(out or RESULTS_DIR / f"{results['benchmark']}-{device.split(':')[0]}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the server may run its backend in child processes)."""
    try:
        import psutil

        proc = psutil.Process(pid)
        return [pid] + [c.pid for c in proc.children(recursive=True)]
    except ImportError:
        pass
    except Exception:
        return [pid]
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def busy_cpu_seconds(pids: list[int]) -> tuple[float, float] | None:
    """CPU seconds used so far by the whole machine and by ``pids`` (Linux /proc; None elsewhere)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = os.sysconf("SC_CLK_TCK")
        busy = sum(int(x) for i, x in enumerate(fields[:8]) if i not in (3, 4))  # all but idle, iowait
        own = 0
        for pid in pids:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            own += int(stat[11]) + int(stat[12])  # utime, stime
        return busy / ticks, own / ticks
    except (OSError, ValueError, IndexError):
        return None
