"""Activation checkpointing per decoder layer: a recomputed layer keeps only its input for the
backward pass and runs again there, for one more forward pass of its compute.

How many layers a micro-batch recomputes is the trainer's choice (``Trainer.layers_to_recompute``):
all of them above a token threshold, or, given a memory budget, as few as keep the others'
stored activations within it. For that it needs what one layer stores per token, which this
module measures on real passes (:class:`SavedBytes`: the bytes autograd saves inside the stored
layers) rather than predicting it from a config, so that it holds for the architecture, dtype,
attention kernel and shard at hand; it is the same on every rank of a tensor-parallel group
(their shards have one shape), so their choices agree. It is a figure per token: what grows
faster than the tokens (an attention kernel that keeps a ``T x T`` matrix) it under-counts for
sequences longer than the ones it was measured on.

The first ``count`` layers are the ones recomputed (megatron's "block" method): the backward pass
reaches them last, after the stored layers after them have freed their activations.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
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
    once. Parameters are not activations: the layers' own and those in ``exclude`` (adapters
    held outside the layers) are left out; what else does not grow with the tokens (a stack of
    several adapters' matrices) counts, a constant that errs on the safe side. A recomputed
    layer's checkpoint keeps its saved tensors out of sight: only stored layers count.

        with SavedBytes(model.layers[k:], exclude=adapter_params) as saved:
            loss = ...forward...
        saved.bytes  # what those layers keep until the backward pass
    """

    def __init__(self, layers: Sequence[nn.Module], exclude: Iterable[Tensor] = ()) -> None:
        self.layers = list(layers)
        params = [p for layer in self.layers for p in layer.parameters()] + list(exclude)
        self.params = {p.untyped_storage().data_ptr() for p in params}
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
    """How many of a micro-batch's ``layers`` decoder layers may keep their activations: all if
    they fit ``budget_bytes`` at ``bytes_per_token_layer``; else as many as fit less one, a
    margin for what the backward pass holds beside them (the layer it recomputes at a time, its
    gradients) and for the recomputed layers' kept inputs."""
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
