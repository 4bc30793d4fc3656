"""tinker-cookbook's sl_loop recipe trains against the real server and its NLL goes down.

The recipe runs unmodified in a subprocess (tests/clients/sl_loop_offline.py only swaps the HF
dataset for in-memory arithmetic chats and stubs the final checkpoint save). The tokenizer for
``Qwen/Qwen3-8B-Base`` comes from a seeded offline HF cache holding the tiny model's tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ALIAS = "Qwen/Qwen3-8B-Base"  # the name tests/conftest.py serves the tiny model under
DRIVER = Path(__file__).parent / "clients" / "sl_loop_offline.py"
BATCH_SIZE = 8
MAX_STEPS = 16
SNAPSHOT = "0" * 40


def seed_hf_cache(hf_home: Path, model_dir: Path, repo_id: str) -> None:
    """Make ``AutoTokenizer.from_pretrained(repo_id)`` resolve offline to the tiny model's tokenizer."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / SNAPSHOT
    snap.mkdir(parents=True)
    # config.json is required: AutoTokenizer fails offline without it.
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(model_dir / name, snap / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sl_loop_nll_goes_down(base_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    hf_home = tmp_path / "hf_home"
    seed_hf_cache(hf_home, tiny_model_dir, ALIAS)
    log_path = tmp_path / "sl_loop"

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_DATASETS_CACHE")}
    env.update(
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TINKER_API_KEY="tml-test",
        TINKER_TELEMETRY="0",
        TINKER_BASE_URL=base_url,
    )
    cmd = [
        sys.executable,
        str(DRIVER),
        f"base_url={base_url}",
        f"log_path={log_path}",
        f"model_name={ALIAS}",
        f"batch_size={BATCH_SIZE}",
        "learning_rate=3e-3",
        f"max_steps={MAX_STEPS}",
        "lora_rank=8",
        "max_length=64",
        "save_every=0",
    ]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"sl_loop driver timed out:\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, f"sl_loop driver failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-6000:]}"

    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in metrics if "train_mean_nll" in m]
    assert [m["step"] for m in steps] == list(range(MAX_STEPS))
    assert all(m["num_sequences"] == BATCH_SIZE for m in steps)
    first, last = steps[0]["train_mean_nll"], steps[-1]["train_mean_nll"]
    assert last < 0.5 * first, f"NLL did not drop enough: first={first:.4f} last={last:.4f}"

    # The recipe's final save is stubbed until the checkpoint milestone; it must still be reached.
    saves = [json.loads(line) for line in (log_path / "skipped_checkpoints.jsonl").read_text().splitlines()]
    assert [(s["name"], s["kind"]) for s in saves] == [("final", "both")]
