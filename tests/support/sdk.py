"""SDK helpers: a cross-entropy datum, an RL datum with provenance, a ``forward``'s log-probs, an export
downloaded through its signed URLs."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import tinker
from tinker import types


def datum(tokens: list[int], weight: float = 1.0) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [weight] * (len(tokens) - 1)},
    )


def forward_logprobs(tc, tokens: list[int]) -> np.ndarray:
    out = tc.forward([datum(tokens, 0.0)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def download(base_url: str, path: str, into: Path) -> Path:
    urls = tinker.RestClient(base_url=base_url).get_external_weights_urls(path).result().urls
    into.mkdir(parents=True)
    for name, url in urls.items():
        (into / name).write_bytes(httpx.get(url, timeout=60).raise_for_status().content)
    return into


def rl_datum(seq: types.SampledSequence, advantage: float, prompt: list[int], logprobs=None) -> types.Datum:
    """rl_loop's datum for one sampled sequence, with rl_loop's provenance."""
    ob_len, sampled = len(prompt) - 1, list(seq.tokens)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + sampled[:-1]),
        loss_fn_inputs={
            "target_tokens": [0] * ob_len + sampled,
            "logprobs": [0.0] * ob_len + list(logprobs if logprobs is not None else seq.logprobs),
            "advantages": [0.0] * ob_len + [advantage] * len(sampled),
        },
    )
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled)),
        ],
    )
