"""PEFT adapters on one HF module tree, each token run under its own model's adapter.

PEFT holds the LoRA modules, their names, state-dict keys and ``adapter_config.json``; it does
not apply them. Its layers are kept disabled (they return the base layer's output) and a forward
hook on each adds the LoRA update of the adapter that ``Routes`` names for each span of tokens,
with PEFT's own arithmetic (``B(A(dropout(x))) · scaling``, in the adapter's dtype). One model's
request is one span; several models' requests packed into one pass over the base are several
spans, each token updated by its own model's adapter only, so each model's loss depends on its
own adapter alone and its gradients are its own.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

# [start, end) of the token stream (end None: to its end, however long), and the adapter it runs under
Segment = tuple[int, int | None, str]


def segments(names: list[str], lengths: list[int]) -> list[Segment]:
    """Spans of consecutive sequences under the same adapter: sequence i has ``lengths[i]``
    tokens and runs under ``names[i]``."""
    out: list[Segment] = []
    start = 0
    for name, n in zip(names, lengths, strict=True):
        if out and out[-1][2] == name:
            out[-1] = (out[-1][0], start + n, name)
        else:
            out.append((start, start + n, name))
        start += n
    return out


class Routes:
    """Which adapter each token runs under: segments covering the token dimension (``-2``) of
    what the LoRA layers see. ``logprobs`` sets them and they stay set until its next call,
    because the backward pass runs recomputed layers again and they must see the same."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    def everything(self, name: str | None) -> None:
        """Every token under adapter ``name`` (None: the base model alone), whatever the input."""
        self.segments = [] if name is None else [(0, None, name)]

    @contextmanager
    def whole(self, name: str) -> Iterator[None]:
        """While inside, every token under ``name``; then the segments as they were."""
        saved = self.segments
        self.everything(name)
        try:
            yield
        finally:
            self.segments = saved

    def head(self, module: nn.Module, name: str) -> Callable[[Tensor], Tensor]:
        """``module`` (the output layer) applied under ``name`` alone, as a function that sets its
        own route: when its chunks are recomputed in the backward pass they route the same."""

        def apply(hidden: Tensor) -> Tensor:
            with self.whole(name):
                return module(hidden)

        return apply


def lora_update(layer: nn.Module, x: Tensor, name: str) -> Tensor:
    """PEFT's LoRA update of ``layer`` (a ``peft.tuners.lora.Linear``) for adapter ``name`` on
    ``x`` (``(..., tokens, in)`` -> ``(..., tokens, out)``); zero where that adapter has none."""
    if name not in layer.lora_A:
        return x.new_zeros((*x.shape[:-1], layer.out_features))
    a = layer.lora_A[name]
    return layer.lora_B[name](a(layer.lora_dropout[name](x.to(a.weight.dtype)))) * layer.scaling[name]


class PeftAdapters:
    """PEFT adapters on one HF module tree: added, removed, applied per ``routes``. PEFT wraps
    the tree in place with the first adapter and refuses to delete its last, so both ends live
    here."""

    def __init__(self, base: nn.Module) -> None:
        self.base = base
        self.peft = None  # the PeftModel, from the first adapter on
        self.routes = Routes()
        self._next = 0
        self._routed: set[int] = set()  # ids of the LoRA layers that carry our hook

    @property
    def lm(self) -> nn.Module:
        """The causal LM, with whatever adapters are in it."""
        return self.peft.base_model.model if self.peft is not None else self.base

    def add(self, config) -> str:
        from peft import get_peft_model

        name = f"a{self._next}"
        self._next += 1
        with warnings.catch_warnings():
            # LoRA on a tied lm_head is what train_unembed means; the embedding stays untouched.
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            if self.peft is None:
                self.peft = get_peft_model(self.base, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
        self._route_layers()
        return name

    def _route_layers(self) -> None:
        """Every LoRA layer disabled in PEFT's forward and updated by our hook instead (a new
        adapter may have wrapped layers that had none)."""
        from peft.tuners.lora import LoraLayer

        for module in self.peft.modules():
            if isinstance(module, LoraLayer):
                module.enable_adapters(False)  # PEFT's forward: the base layer alone
                if id(module) not in self._routed:
                    module.register_forward_hook(self._add_updates)
                    self._routed.add(id(module))

    def _add_updates(self, layer: nn.Module, args: tuple, output: Tensor) -> Tensor:
        if not self.routes.segments:
            return output
        x = args[0]
        spans = [(s, x.shape[-2] if e is None else e, name) for s, e, name in self.routes.segments]
        updates = [lora_update(layer, x.narrow(-2, s, e - s), name) for s, e, name in spans]
        update = updates[0] if len(updates) == 1 else torch.cat(updates, dim=-2)  # one model: no copy
        return (output + update).to(output.dtype)

    def params(self, name: str) -> list[tuple[str, nn.Parameter]]:
        """The adapter's parameters under PEFT's state-dict keys, in module order."""
        return [(n.replace(f".{name}.", "."), p) for n, p in self.peft.named_parameters() if f".{name}." in n]

    def remove(self, name: str) -> None:
        if len(self.peft.peft_config) > 1:
            with warnings.catch_warnings():  # "adapter X was active": PEFT's choice of active is unused
                warnings.simplefilter("ignore", UserWarning)
                self.peft.delete_adapter(name)
        else:  # its last adapter: unwrap back to the bare base model (and its LoRA layers go)
            self.base = self.peft.unload()
            self.peft = None
            self._routed.clear()

    def config(self, name: str) -> dict:
        config = self.peft.peft_config[name].to_dict()
        return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
