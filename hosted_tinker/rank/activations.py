"""Activation checkpointing per decoder layer: a layer keeps only its input for the backward
pass and runs again there, so a step's activation memory is one layer's plus one hidden state
per layer — linear in tokens, with a small slope — for one more forward pass of compute."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn
from torch.utils.checkpoint import checkpoint


@contextmanager
def recomputed(layers: Sequence[nn.Module], enabled: bool) -> Iterator[None]:
    """While inside, each of ``layers`` (when ``enabled`` and autograd is on) saves only its
    inputs and recomputes itself in the backward pass. Module hooks stay outside the checkpoint
    (the instance's ``forward`` is wrapped, not ``__call__``), so they are not run twice."""
    if not enabled:
        yield
        return
    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again
