"""tinker-cookbook's sl_loop recipe trains against the real server and its NLL goes down.

The recipe runs unmodified in a subprocess (tests/support/clients/sl_loop_offline.py only swaps the HF
dataset for in-memory arithmetic chats and stubs the final checkpoint save). The tokenizer for
``Qwen/Qwen3-8B-Base`` comes from a seeded offline HF cache holding the tiny model's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.clients.cookbook import RECIPE_EXTRAS, offline_env, read_jsonl, require_cookbook, run_recipe
from tests.support.server import ALIAS, ServerProcess

require_cookbook(*RECIPE_EXTRAS)  # the driver runs the recipe in a subprocess

DRIVER = Path(__file__).resolve().parents[1] / "support" / "clients" / "sl_loop_offline.py"
BATCH_SIZE = 8
MAX_STEPS = 16
RUN_TIMEOUT_S = 300


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sl_loop_nll_goes_down(server: ServerProcess, base_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    env = offline_env(tmp_path / "hf_home", tiny_model_dir, base_url)
    log_path = tmp_path / "sl_loop"

    cmd = [
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
    run_recipe("sl_loop driver", cmd, server=server, env=env, cwd=tmp_path, timeout=RUN_TIMEOUT_S)

    metrics = read_jsonl(log_path / "metrics.jsonl")
    steps = [m for m in metrics if "train_mean_nll" in m]
    assert [m["step"] for m in steps] == list(range(MAX_STEPS))
    assert all(m["num_sequences"] == BATCH_SIZE for m in steps)
    first, last = steps[0]["train_mean_nll"], steps[-1]["train_mean_nll"]
    assert last < 0.5 * first, f"NLL did not drop enough: first={first:.4f} last={last:.4f}"

    # The recipe's final save is stubbed until the checkpoint milestone; it must still be reached.
    saves = read_jsonl(log_path / "skipped_checkpoints.jsonl")
    assert [(s["name"], s["kind"]) for s in saves] == [("final", "both")]
