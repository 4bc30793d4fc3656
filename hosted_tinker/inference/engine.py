"""The small interface every inference engine implements, and the weights a request names.

Two engines sit behind it: ``EmbeddedEngine`` (the training backend's own batched decoder, on
the worker) and ``VllmEngine`` (a co-launched or external vLLM server, adapters synced to it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hosted_tinker.core.checkpoints import CheckpointFiles, TinkerPath
from hosted_tinker.core.sampling import SampleOutput, SampleSpec


@dataclass(frozen=True)
class WeightsRef:
    """Which weights a request samples.

    - the base model: ``key`` None;
    - a saved adapter (``sampler_weights``/``weights`` checkpoint or ephemeral snapshot): ``key``
      is its ``tinker://`` path and ``files``/``path`` locate it;
    - the live adapter of a training run (vLLM only): ``live`` is the run's model id.
    """

    key: str | None
    files: CheckpointFiles | None = None
    path: TinkerPath | None = None
    live: str | None = None

    def directory(self) -> Path | None:
        return self.files.directory(self.path) if self.files is not None and self.path is not None else None

    def saved(self) -> tuple[CheckpointFiles, TinkerPath]:
        """Where a saved adapter's files are; ``ValueError`` for other weights."""
        if self.files is None or self.path is None:
            raise ValueError(f"{self.key or 'the base model'} is not a saved adapter")
        return self.files, self.path


# (sample index, token, logprob): one request's tokens, as they are sampled.
SampleListener = Callable[[int, int, float], None]


class InferenceEngine(Protocol):
    name: str

    async def sample(
        self, weights: WeightsRef, spec: SampleSpec, on_token: SampleListener | None = None
    ) -> SampleOutput:
        """Sample ``spec`` on ``weights``; raise ``UserError`` for a request the engine refuses.
        ``on_token`` hears each token as soon as the engine has it."""
        ...

    def status(self) -> dict:
        """What ``/healthz`` shows about this engine."""
        ...
