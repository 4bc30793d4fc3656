"""Run tinker-cookbook's ``recipes/rl_loop.py`` unmodified against a self-hosted server, offline.

Usage (any ``rl_loop.Config`` field may be given, chz ``key=value`` syntax)::

    python tests/support/clients/rl_loop_offline.py base_url=http://127.0.0.1:PORT log_path=RUNS/rl \
        model_name=Qwen/Qwen3-8B-Base batch_size=4 group_size=4 max_tokens=12 max_steps=8

The recipe's defaults stay, ``loss_fn="stable_reinforce"`` among them: it samples with
``record_stability_info=True`` and trains with provenance spans. Two things are replaced before
``rl_loop.main`` runs:

* ``datasets.load_dataset("openai/gsm8k", "main")`` returns GSM8K-shaped rows (a question, an
  answer ending ``#### N``) held in memory.
* ``rl_loop.get_reward`` gives a dense reward a tiny random model can climb in a few steps: the
  share of the response's characters that are lowercase ASCII letters (with a small
  tie-breaker). It starts near 0.4, so it has room to climb (the share of ASCII characters, used
  before, starts near 0.9: its climb sat inside the sampling noise in about one run in six).
  GSM8K's own reward (a correct boxed answer) is always 0 for such a model, so every advantage
  would be 0 and the recipe would skip every training step.
"""

from __future__ import annotations

from typing import Any

import chz
import datasets
from tinker_cookbook.recipes import rl_loop

DATASET = ("openai/gsm8k", "main")
ROWS = 64


def gsm8k_rows() -> list[dict[str, str]]:
    return [
        {"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?", "answer": f"#### {a + b}"}
        for a, b in ((i % 9 + 1, i % 7 + 2) for i in range(ROWS))
    ]


def fake_load_dataset(path: str, name: str | None = None, *args: Any, **kwargs: Any) -> datasets.DatasetDict:
    if (path, name) != DATASET:
        raise ValueError(f"offline driver only provides {DATASET!r}, got {(path, name)!r}")
    return datasets.DatasetDict({"train": datasets.Dataset.from_list(gsm8k_rows())})


def lowercase_share(response: str, answer: str) -> float:
    """The share of characters in ``a``-``z``, and a tie-breaker a thousand times smaller (distinct
    characters): samples that differ rarely tie. Identical ones do, once the policy has collapsed
    to one answer; then every advantage of the group is 0, and the recipe skips the step if all
    groups are so."""
    if not response:
        return 0.0
    return sum("a" <= c <= "z" for c in response) / len(response) + 1e-4 * len(set(response))


def run(config: rl_loop.Config) -> None:
    rl_loop.datasets.load_dataset = fake_load_dataset
    rl_loop.get_reward = lowercase_share
    rl_loop.main(config)


if __name__ == "__main__":
    chz.nested_entrypoint(run)
