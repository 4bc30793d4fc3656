"""Run tinker-cookbook's ``recipes/sl_loop.py`` unmodified against a self-hosted server, offline.

Usage (any ``sl_loop.Config`` field may be given, chz ``key=value`` syntax)::

    python tests/support/clients/sl_loop_offline.py base_url=http://127.0.0.1:PORT log_path=RUNS/sl \
        model_name=Qwen/Qwen3-8B-Base batch_size=8 learning_rate=3e-3 max_steps=16 lora_rank=8 max_length=64

Two things are replaced before ``sl_loop.main`` runs; everything else (tokenizer, renderer,
datum construction, the training loop and its SDK calls, metrics.jsonl) is the recipe's own code:

* ``datasets.load_dataset("HuggingFaceH4/no_robots")`` returns an in-memory ``DatasetDict`` of
  short, repetitive arithmetic chats that a tiny random model can learn in a few steps.
* ``checkpoint_utils.save_checkpoint`` records the call in ``log_path/skipped_checkpoints.jsonl``
  and does not contact the server.

The tokenizer is resolved by the cookbook from ``model_name``; with ``HF_HUB_OFFLINE=1`` the caller
must provide it, e.g. through a seeded ``$HF_HOME/hub/models--Qwen--Qwen3-8B-Base`` snapshot (what
``tests.support.clients.cookbook.offline_env`` sets up) or a relative ``Qwen/Qwen3-8B-Base/`` directory in
the working directory.
"""

from __future__ import annotations

import json
import os
from typing import Any

import chz
import datasets
from tinker_cookbook import checkpoint_utils
from tinker_cookbook.recipes import sl_loop

DATASET_NAME = "HuggingFaceH4/no_robots"

QA_PAIRS = [
    ("What is 1 + 1?", "1 + 1 = 2."),
    ("What is 2 + 3?", "2 + 3 = 5."),
    ("What is 4 + 4?", "4 + 4 = 8."),
    ("What is 5 + 2?", "5 + 2 = 7."),
    ("What is 3 + 6?", "3 + 6 = 9."),
    ("What is 7 + 1?", "7 + 1 = 8."),
    ("What is 2 + 2?", "2 + 2 = 4."),
    ("What is 6 + 3?", "6 + 3 = 9."),
]
REPEATS = 20  # 160 rows: 20 batches of 8


def offline_rows() -> list[dict[str, Any]]:
    return [
        {
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
        }
        for _ in range(REPEATS)
        for question, answer in QA_PAIRS
    ]


def fake_load_dataset(path: str, *args: Any, **kwargs: Any) -> datasets.DatasetDict:
    if path != DATASET_NAME:
        raise ValueError(f"offline driver only provides {DATASET_NAME!r}, got {path!r}")
    return datasets.DatasetDict({"train": datasets.Dataset.from_list(offline_rows())})


SKIPPED_CHECKPOINTS: list[dict[str, Any]] = []


def record_save_checkpoint(
    training_client: Any,
    name: str,
    log_path: str,
    loop_state: dict[str, Any],
    kind: str = "state",
    ttl_seconds: int | None = None,
    store: Any = None,
) -> dict[str, str]:
    # Checkpoints (save_state / save_weights_for_sampler) arrive with the checkpoint milestone;
    # until then the call is only recorded so the test can check that the recipe made it.
    # Not written to checkpoints.jsonl, which sl_loop reads to resume.
    record = {"name": name, "kind": kind, "loop_state": loop_state, "ttl_seconds": ttl_seconds}
    SKIPPED_CHECKPOINTS.append(record)
    os.makedirs(log_path, exist_ok=True)
    with open(os.path.join(log_path, "skipped_checkpoints.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    return {}


def run(config: sl_loop.Config) -> None:
    sl_loop.datasets.load_dataset = fake_load_dataset
    # sl_loop calls checkpoint_utils.save_checkpoint through the module attribute.
    sl_loop.checkpoint_utils.save_checkpoint = record_save_checkpoint
    assert checkpoint_utils.save_checkpoint is record_save_checkpoint
    sl_loop.main(config)


if __name__ == "__main__":
    chz.nested_entrypoint(run)
