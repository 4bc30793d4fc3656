"""What a sampling request asks for and what it gets back, on either side of the worker pipe.

The decode loop that fills these in runs in rank 0's process (``rank.generate``); the codecs
and services that build and answer them run on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from hosted_tinker.core.images import ImageInput

MASK_LOGPROB = -99999.0  # the SDK's marker for an empty top-k cell

# (request index, sample index, token, logprob), for each token of a streamed request.
TokenListener = Callable[[int, int, int, float], None]
# (request index, its output), once every row of that request has left the decode.
FinishListener = Callable[[int, "SampleOutput"], None]


@dataclass
class SampleSpec:
    """One sampling request (protocol reference §3.4, §6.5)."""

    prompt: list[int]
    max_tokens: int
    num_samples: int = 1
    temperature: float = 1.0
    top_k: int = -1  # -1: no limit
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    topk_sample_logprobs: int = 0
    # int64 (len(prompt) - 1, K): row i names token ids to score at prompt position i + 1; -1 none
    target_prompt_ids: Tensor | None = None
    # k draws per prompt position >= 1 from the model's distribution, at the request's sampling
    prompt_alt_tokens_k: int = 0
    # Report each sampled token as it is chosen, through ``generate``'s ``on_token`` (streaming).
    stream: bool = False
    # the prompt's images, each over a run of the model's image token in ``prompt`` (``core.images``)
    images: tuple[ImageInput, ...] = ()
    # Record which experts each token was routed to, for routing replay (``rank.routing_replay``):
    # a mixture-of-experts model's ``SampleOutput.prompt_routing`` and ``SampledSequence.routing``.
    record_routing: bool = False

    @property
    def scores_prompt(self) -> bool:
        """Whether the prefill must look at every prompt position, not only the last."""
        return bool(
            self.prompt_logprobs
            or self.topk_prompt_logprobs
            or self.target_prompt_ids is not None
            or self.prompt_alt_tokens_k
        )


@dataclass
class SampledSequence:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str = "length"  # or "stop"
    # If asked, the k best tokens at each sampled position: ids int32 (L, k), log-probs float32
    # (L, k), MASK_LOGPROB in a cell no token fills. Arrays: as Python lists, many long samples'
    # (millions of numbers) held the GIL, and the event loop, while they crossed the worker pipe.
    topk: tuple[np.ndarray, np.ndarray] | None = None
    # With ``record_routing``, on a mixture-of-experts model: int16 ``(len(tokens), layers, top_k)``,
    # the experts each sampled token went to when it was fed back; the last token never is (-1).
    routing: np.ndarray | None = None


@dataclass
class SampleOutput:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float] | None = None  # NaN where undefined (position 0, before last_n)
    topk_prompt: tuple[Tensor, Tensor] | None = None  # ids int32 (L, k), logprobs float32 (L, k)
    target_prompt: Tensor | None = None  # float32 (L - 1, K): log-probs of target_prompt_ids, 0.0 at -1
    prompt_alt: tuple[Tensor, Tensor] | None = None  # tokens int64 (L - 1, k), their log-probs float32
    prompt_routing: np.ndarray | None = None  # with record_routing: int16 (len(prompt), layers, top_k)


@dataclass
class Admission:
    """What the server hands a running decode between its steps (``generate``'s ``admit``):
    requests that join it, on the same weights, the numbers of requests whose clients gave
    up (``cancel_future``), whose rows leave it, and whether its time slice is over (the
    decode pauses, its state kept, and gives the worker back)."""

    arrivals: list[SampleSpec] = field(default_factory=list)
    dropped: tuple[int, ...] = ()
    pause: bool = False
