"""Measuring what a stored decoder layer keeps per token (``stored_bytes_per_token``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hosted_tinker.core.types import LoraSpec
from hosted_tinker.rank.activations import SavedBytes
from hosted_tinker.rank.serve import local_rank
from tests.support.batches import random_batch


def stored_bytes_per_token(model_dir: Path, dtype: str, device: str, passes: list[tuple[int, int]]) -> list[float]:
    """What the stored layers keep per token and layer (``SavedBytes``), in passes of one
    sequence of ``n`` tokens with the first ``k`` layers recomputed, on ``device``."""
    rank = local_rank(str(model_dir), dtype=dtype, device=device)
    rank.trainer.create_adapter("m", LORA)
    model, handle = rank.trainer.model, rank.trainer.adapters["m"].handle
    figures = []
    for n, k in passes:
        data = random_batch(np.random.default_rng(0), 1, lengths=(n, n + 1)).data
        with SavedBytes(model.layers[k:], exclude=handle.params) as saved:
            model.logprobs([handle], data, recompute=k)
        figures.append(saved.bytes / n / (len(model.layers) - k))
    return figures


LORA = LoraSpec(rank=8, seed=4)
