"""LoRA adapters on one HF module tree, each token run under its own model's adapter.

The base model's linear layers are never replaced. A forward hook on each layer an adapter
wraps adds, per span of tokens, the update of the adapter that ``Routes`` names for that span:
``B(A x) · scale``, PEFT's arithmetic: float32 adapters whatever the base dtype, their products
and the sum in float32, cast back to the layer's output dtype; or, with ``compute="base"``, the
products and the sum in the base's dtype, as PEFT under ``torch.autocast`` (the adapters, their
gradients and so the optimizer's state stay float32). On a bfloat16 base the float32 products
run off the GPU's tensor cores and cast every layer's input up and its output down: a third of
the busy time of Qwen3-8B's 4K-token step on an H200 (``benchmarks/results/profile_step-h200.json``).

One model's request is one span; several models' requests packed into one pass over the base
are several spans, each token updated by its own model's adapter only, so each model's loss
depends on its own adapter alone and its gradients are its own.

An adapter is a handful of plain parameters per layer (``Lora``), so adding or removing one
costs its own layers whatever else is resident. PEFT's ``add_adapter`` walked every module of
every resident adapter: 2.1 s to add the 64th on a 0.5B model, on the thread every tenant's
training waits on. PEFT still defines what an adapter is here: parameters are keyed by its
state-dict names (``base_model.model.<module>.lora_A.weight``), drawn as it draws them for a
seed, and described by its ``adapter_config.json``; checkpoints add only Tinker's name for the
unembedding's LoRA (``core.checkpoints.adapter_files``). Routed experts, which PEFT has no
linear layer for, take Tinker's 3-D layout (``rank.experts``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hosted_tinker.rank.experts import (
    COUNTER_ATTR,
    HOOK_ATTR,
    PROJECTIONS,
    ExpertsHook,
    ExpertSpan,
    RoutingCounter,
    experts_modules,
    use_lora_experts,
)
from hosted_tinker.rank.hf import CausalLM
from hosted_tinker.rank.linear_attention import split_targets
from hosted_tinker.rank.lora_products import add_into, in_dtype, lora_down, products_dtype, scaled
from hosted_tinker.rank.routing_replay import RouterTape

# [start, end) of the token stream (end None: to its end, however long), and the adapter it runs under
Segment = tuple[int, int | None, str]
KEY_PREFIX = "base_model.model."  # PEFT's state-dict keys start so
COMPUTE = ("float32", "base")  # the dtype of LoRA's products: the adapters' own, or the base's


def checked_compute(compute: str) -> str:
    """``compute`` if it is one of ``COMPUTE`` (``--lora-compute``), else ``ValueError``."""
    if compute not in COMPUTE:
        raise ValueError(f"lora compute {compute!r}: one of {', '.join(COMPUTE)}")
    return compute


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


# ---- one adapter ----------------------------------------------------------------------------------


@dataclass
class Lora:
    """One linear layer's LoRA under one adapter: ``y += scale · B(A x)``; or one projection of
    a layer's routed experts, one LoRA per expert (``rank.experts``)."""

    A: nn.Parameter  # (r, in), or (E or 1, r, in): 1 is one for every expert
    B: nn.Parameter  # (out, r), or (E or 1, out, r)


@dataclass
class Adapter:
    layers: dict[str, Lora]  # module name -> its LoRA, in the model's module order (PEFT's)
    scale: float  # lora_alpha / r

    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        """Parameters under PEFT's state-dict keys, in PEFT's order (per module: A, then B)."""
        return [
            (f"{KEY_PREFIX}{module}.lora_{part}.weight", matrix)
            for module, lora in self.layers.items()
            for part, matrix in (("A", lora.A), ("B", lora.B))
        ]


def kaiming(rows: int, cols: int) -> Tensor:
    """``nn.Linear``'s default init (kaiming-uniform, a=√5) of a (rows, cols) weight, drawing
    from the process RNG exactly as ``nn.Linear(cols, rows)`` does."""
    weight = torch.empty(rows, cols)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    return weight


def draw_lora(in_features: int, out_features: int, rank: int) -> tuple[Tensor, Tensor]:
    """One layer's new (A, B), drawn as PEFT draws them: ``A``'s ``nn.Linear``, ``B``'s, then
    ``A`` again (its LoRA reset); ``B`` zero. Call in the model's module order under a seeded
    RNG and a seed starts a model exactly where PEFT starts it."""
    kaiming(rank, in_features)  # lora_A's nn.Linear
    kaiming(out_features, rank)  # lora_B's nn.Linear
    return kaiming(rank, in_features), torch.zeros(out_features, rank)


def draw_expert_lora(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """One experts projection's new (A, B) of these shapes (``rank.experts``): each ``A`` (one
    for all experts, or each expert's) as ``nn.Linear(in, r)`` draws its weight, one after
    another; ``B`` zero, so a new adapter changes nothing, as a dense one."""
    count, rank, in_features = a_shape
    return torch.stack([kaiming(rank, in_features) for _ in range(count)]), torch.zeros(b_shape)


def lora_config(rank: int, alpha: float, modules: list[str], base: str) -> dict:
    """The ``adapter_config.json`` PEFT writes for a LoRA of ``rank`` on ``modules`` of ``base``."""
    from peft import LoraConfig

    config = LoraConfig(  # PEFT annotates lora_alpha as int, but keeps and scales by any number
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]
        lora_dropout=0.0,
        target_modules=modules,
        base_model_name_or_path=base,
    ).to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


# ---- adapters on a module tree --------------------------------------------------------------------


class LoraAdapters:
    """Adapters on one HF module tree, by name, applied per ``routes``. A layer gets its hook
    when the first adapter on it arrives, and keeps it (an idle hook returns at once)."""

    def __init__(self, lm: CausalLM, compute: str = "float32") -> None:
        self.lm = lm  # the causal LM; its modules are never replaced
        self.compute = checked_compute(compute)
        self.routes = Routes()
        self.adapters: dict[str, Adapter] = {}  # by the names ``add`` gives: a0, a1, ...
        self._added = 0
        self._hooked: set[str] = set()
        # LoRA targets in the model's order: its modules, and after each fused experts module
        # its projections (``<experts>.w1`` ...), which are not modules of their own
        self.experts = experts_modules(lm)
        # and after each fused q/k/v projection of a Gated-DeltaNet layer, Tinker's separate
        # q, k and v targets (``rank.linear_attention``): row slices of it, each a LoRA of its own
        self.slices = split_targets(lm)
        self._parts: dict[str, list[str]] = {}  # fused linear layer -> its slice targets, in row order
        for target, (fused, _, _) in self.slices.items():
            self._parts.setdefault(fused, []).append(target)
        targets = [
            (
                name,
                *([f"{name}.{p}" for p in PROJECTIONS] if name in self.experts else []),
                *self._parts.get(name, []),
            )
            for name, _ in lm.named_modules()
        ]
        self._order = {target: i for i, target in enumerate(t for group in targets for t in group)}
        use_lora_experts(lm)
        self.routing = RoutingCounter(lambda: self.routes.segments)
        for name in self.experts:
            setattr(lm.get_submodule(name), COUNTER_ATTR, (self.routing, name))
        # the routers, hooked to record what they choose (sampling) or replay a record (training)
        self.replay = RouterTape(lm, self.experts, self.routing)

    def linear(self, module: str) -> nn.Linear:
        """The linear layer ``module`` of the tree (``KeyError`` naming it if there is none)."""
        layer = self.lm.get_submodule(module) if module in self._order else None
        if not isinstance(layer, nn.Linear):
            raise KeyError(module)
        return layer

    def linear_layers(self) -> set[str]:
        """The names of the tree's linear layers (LoRA targets that are modules of their own)."""
        return {name for name, m in self.lm.named_modules() if isinstance(m, nn.Linear)}

    def lora_shapes(self, target: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of ``lora_A`` and ``lora_B`` of a LoRA target: a linear layer's ``(r, in)``
        and ``(out, r)``, or an experts projection's (``<experts>.w1``: ``ExpertsShape.lora_shapes``);
        ``KeyError`` if it is neither."""
        experts, _, projection = target.rpartition(".")
        if experts in self.experts and projection in PROJECTIONS:
            return self.experts[experts].lora_shapes(projection, rank)
        if target in self.slices:
            fused, start, end = self.slices[target]
            return (rank, self.linear(fused).in_features), (end - start, rank)
        out_features, in_features = self.linear(target).weight.shape
        return (rank, in_features), (out_features, rank)

    def in_model_order(self, modules: Iterable[str]) -> list[str]:
        return sorted(set(modules), key=self._order.__getitem__)

    def new(self, modules: list[str], rank: int, alpha: float, seed: int, device: torch.device) -> Adapter:
        """A new adapter of ``rank`` on ``modules``, initialised as PEFT initialises it for ``seed``
        (without disturbing the process RNG)."""
        layers: dict[str, Lora] = {}
        with torch.random.fork_rng(devices=[]):
            # the CPU generator only (it draws on the CPU): torch.manual_seed would also reseed CUDA's
            # for good, which fork_rng(devices=[]) does not restore
            torch.random.default_generator.manual_seed(seed)
            for module in self.in_model_order(modules):
                a_shape, b_shape = self.lora_shapes(module, rank)
                a, b = (
                    draw_lora(a_shape[1], b_shape[0], rank) if len(a_shape) == 2 else draw_expert_lora(a_shape, b_shape)
                )
                layers[module] = Lora(nn.Parameter(a.to(device)), nn.Parameter(b.to(device)))
        return Adapter(layers, alpha / rank)

    def add(self, adapter: Adapter) -> str:
        """Put ``adapter`` on the tree; the name routes use for it."""
        for module in adapter.layers:
            experts, _, projection = module.rpartition(".")
            if experts in self.experts and projection in PROJECTIONS:
                if experts not in self._hooked:
                    hook = ExpertsHook(self._expert_spans(experts), self.compute)
                    setattr(self.lm.get_submodule(experts), HOOK_ATTR, hook)
                    self._hooked.add(experts)
            else:
                layer = self.slices[module][0] if module in self.slices else module
                if layer not in self._hooked:
                    self.linear(layer).register_forward_hook(self._hook(layer))
                    self._hooked.add(layer)
        name = f"a{self._added}"
        self._added += 1
        self.adapters[name] = adapter
        return name

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)

    def _hook(self, module: str) -> Callable[[nn.Module, tuple, Tensor], Tensor]:
        parts = self._parts.get(module, [])

        def add_updates(layer: nn.Module, args: tuple, output: Tensor) -> Tensor:
            x = args[0]
            dtype = products_dtype(self.compute, output.dtype)
            whole = self._spans(module, x)
            update = (
                None if all(span.lora is None for span in whole) else span_updates(x, whole, output.shape[-1], dtype)
            )
            if parts:  # Tinker's q/k/v of a fused projection: each slice of rows its own LoRA
                sliced = [self._spans(part, x) for part in parts]
                if any(span.lora is not None for spans in sliced for span in spans):
                    rows = [self.slices[part][2] - self.slices[part][1] for part in parts]
                    by_rows = torch.cat([span_updates(x, s, n, dtype) for s, n in zip(sliced, rows, strict=True)], -1)
                    update = by_rows if update is None else update + by_rows
            return output if update is None else add_into(output, update)

        return add_updates

    def _spans(self, module: str, x: Tensor) -> list[Span]:
        """The spans of ``module``'s input ``x`` as routed now, each with its adapter's LoRA there."""
        return [
            self._span(module, start, x.shape[-2] if end is None else end, name)
            for start, end, name in self.routes.segments
        ]

    def _expert_spans(self, experts: str) -> Callable[[int], list[ExpertSpan]]:
        """The spans of a fused experts module's input of ``tokens`` tokens, as routed now."""

        def spans(tokens: int) -> list[ExpertSpan]:
            out = []
            for start, end, name in self.routes.segments:
                adapter = self.adapters.get(name)  # None: removed since the routes were set
                loras = (
                    {}
                    if adapter is None
                    else {p: (lora.A, lora.B) for p in PROJECTIONS if (lora := adapter.layers.get(f"{experts}.{p}"))}
                )
                out.append(
                    ExpertSpan(start, tokens if end is None else end, loras, 0.0 if adapter is None else adapter.scale)
                )
            return out

        return spans

    def _span(self, module: str, start: int, end: int, name: str) -> Span:
        adapter = self.adapters.get(name)  # None: removed since the routes were set; no update
        return (
            Span(start, end, None, 0.0)
            if adapter is None
            else Span(start, end, adapter.layers.get(module), adapter.scale)
        )


# ---- the update of a layer, span by span --------------------------------------------------------------


@dataclass
class Span:
    """Tokens [start, end) of a layer's input and the LoRA they run under (None: none here)."""

    start: int
    end: int
    lora: Lora | None
    scale: float


def span_updates(x: Tensor, spans: list[Span], out_features: int, dtype: torch.dtype | None = None) -> Tensor:
    """Each span's LoRA update of ``x`` (``(..., tokens, in)`` -> ``(..., tokens, out)``, in
    ``dtype``: None for the adapters' own, float32), PEFT's ``lora_B(lora_A(x)) * scaling`` per
    span. Spans of one length, each under an adapter of one rank, run as one batch (the adapters'
    matrices stacked, two batched matmuls): a pass of many models' equal requests costs two
    matmuls per layer, not two per model. (Spans of unequal length would have to be copied
    together, which costs more than it saves on a CPU.)"""
    if len(spans) == 1 and spans[0].lora is not None:  # one model: no copy
        return _update(x, spans[0], spans[0].lora, dtype)
    if (loras := _batchable(x, spans)) is not None:
        count, length = len(spans), spans[0].end - spans[0].start
        a = in_dtype(torch.stack([lora.A for lora in loras]), dtype)  # (S, r, in)
        b = in_dtype(torch.stack([lora.B for lora in loras]), dtype)  # (S, out, r)
        scales = [span.scale for span in spans]
        scale = (
            scales[0]
            if len(set(scales)) == 1
            else torch.tensor(scales, device=x.device, dtype=dtype or torch.float32)[:, None, None]
        )
        xs = x.reshape(count, length, x.shape[-1])  # (S, L, in): a view, span by span
        return scaled(torch.bmm(lora_down(xs, a), b.transpose(1, 2)), scale).reshape(*x.shape[:-1], -1)
    updates = [
        _update(x, span, span.lora, dtype)
        if span.lora is not None
        else x.new_zeros((*x.shape[:-2], span.end - span.start, out_features), dtype=dtype or torch.float32)
        for span in spans
    ]
    return torch.cat(updates, dim=-2)


def _batchable(x: Tensor, spans: list[Span]) -> list[Lora] | None:
    """The spans' LoRAs if ``spans`` cut all of ``x``'s one sequence into equal parts, each
    under a LoRA of the same shape; else None."""
    length = spans[0].end - spans[0].start
    if x.dim() != 3 or x.shape[0] != 1 or len(spans) * length != x.shape[1]:
        return None
    loras = [span.lora for span in spans if span.lora is not None]
    if len(loras) < len(spans):
        return None
    shape = loras[0].A.shape
    same = all(
        lora.A.shape == shape and (span.start, span.end) == (i * length, (i + 1) * length)
        for i, (span, lora) in enumerate(zip(spans, loras, strict=True))
    )
    return loras if same else None


def _update(x: Tensor, span: Span, lora: Lora, dtype: torch.dtype | None) -> Tensor:
    # all of x (one model's pass): not narrowed, whose backward pass would write the gradient
    # into a zeroed copy of the whole input
    whole = span.start == 0 and span.end == x.shape[-2]
    xs = x if whole else x.narrow(-2, span.start, span.end - span.start)
    a, b = in_dtype(lora.A, dtype), in_dtype(lora.B, dtype)  # span.lora's
    return scaled(F.linear(lora_down(xs, a), b), span.scale)
