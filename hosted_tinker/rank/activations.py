"""Activation checkpointing per decoder layer: a recomputed layer keeps only its input for the
backward pass and runs again there, for one more forward pass of its compute.

How many layers a micro-batch recomputes is the trainer's choice (``Trainer.layers_to_recompute``):
all of them above a token threshold, or, given a memory budget, as few as keep the others'
stored activations within it. For that it needs what one layer stores per token, which this
module measures on a real pass (:class:`SavedBytes`) rather than predicting it from a config: it
is exact for any architecture, dtype and sharding, and it is the same on every rank of a
tensor-parallel group (their shards have one shape), so their choices agree.

The first ``count`` layers are the ones recomputed (megatron's "block" method): the backward pass
reaches them last, when the stored layers after them have already freed their activations, so a
recomputed layer's transient and the stored layers' activations are never held at once.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


@contextmanager
def recomputed(layers: Sequence[nn.Module], count: int) -> Iterator[None]:
    """While inside, the first ``count`` of ``layers`` (when autograd is on) save only their
    inputs and recompute themselves in the backward pass. Module hooks stay outside the
    checkpoint (the instance's ``forward`` is wrapped, not ``__call__``), so they do not run twice."""
    chosen = list(layers)[:count] if torch.is_grad_enabled() else []
    for layer in chosen:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    try:
        yield
    finally:
        for layer in chosen:
            del layer.forward  # the class's forward again


class SavedBytes:
    """Counts the bytes autograd keeps for the backward pass while ``layers`` run, each storage
    once. The layers' parameters are not activations and are left out (an adapter's, held
    outside the layer, count: a few MB a layer, a constant that errs on the safe side). A
    recomputed layer's checkpoint keeps its saved tensors out of sight: only stored layers count.

        with SavedBytes(model.layers[k:]) as saved:
            loss = ...forward...
        saved.bytes  # what those layers keep until the backward pass
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self.params = {p.untyped_storage().data_ptr() for layer in self.layers for p in layer.parameters()}
        self.bytes = 0
        self._seen: set[int] = set()
        self._inside = 0
        self._stack = ExitStack()

    def _pack(self, t: Tensor) -> Tensor:
        if self._inside:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._seen and ptr not in self.params:
                self._seen.add(ptr)
                self.bytes += storage.nbytes()
        return t

    def _enter_layer(self, *_: object) -> None:
        self._inside += 1

    def _leave_layer(self, *_: object) -> None:
        self._inside -= 1

    def __enter__(self) -> SavedBytes:
        for layer in self.layers:
            self._stack.callback(layer.register_forward_pre_hook(self._enter_layer).remove)
            self._stack.callback(layer.register_forward_hook(self._leave_layer).remove)
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def layers_to_store(tokens: int, layers: int, bytes_per_token_layer: float, budget_bytes: float) -> int:
    """How many of a micro-batch's ``layers`` decoder layers may keep their activations: as many
    as fit ``budget_bytes`` at ``bytes_per_token_layer``, keeping room for one more (the layer
    the backward pass recomputes at a time, when any is recomputed)."""
    per_layer = tokens * bytes_per_token_layer
    if per_layer * layers <= budget_bytes:
        return layers
    return max(int(budget_bytes // per_layer) - 1, 0)


def free_device_bytes(device: torch.device) -> int | None:
    """What a CUDA device can still give this process: its free memory plus what PyTorch's
    allocator holds unused. None on a CPU (whose memory is not the device's to count)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
