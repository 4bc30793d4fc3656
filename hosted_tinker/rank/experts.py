"""LoRA on the routed experts of a mixture-of-experts layer, where Tinker puts it.

transformers 5 keeps a layer's routed experts as one module of 3-D weights (``gate_up_proj``
``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)``, or their transposes), with gate and up rows
concatenated (Qwen3-MoE, Qwen3.5/3.6-MoE, DeepSeek-V3) or interleaved (gpt-oss). There is no
linear layer per expert to hook, so LoRA enters through transformers' own seam for this: an
experts implementation registered in ``ALL_EXPERTS_FUNCTIONS`` (``lora_experts_forward``), which
``LoraAdapters`` selects on its tree.

Tinker's layout, as its checkpoints name it and the cookbook's ``weights`` tools read it: per
projection ``<experts>.w1`` (gate), ``.w3`` (up) and ``.w2`` (down), a ``lora_A`` and a ``lora_B``
of three dimensions, ``(experts, rank, in)`` and ``(experts, out, rank)``, where the factor on the
hidden-state side is one for all experts (its leading dimension 1, broadcast): gate and up have
one ``A`` ``(1, r, H)`` and each expert's ``B`` ``(E, I, r)``; down has each expert's ``A``
``(E, r, I)`` and one ``B`` ``(1, H, r)``. That is what the service trains: the LoRA parameter
counts the cookbook lists for its MoE models (``hyperparam_utils``, e.g. Qwen3-30B-A3B's
14,450,688 per rank for ``mlp``) are exactly this layout's, and 3.6 times fewer than a full
``(A, B)`` per expert (``tests/unit/rank/test_moe_lora.py`` checks the counts). A token routed to expert
``e`` gets ``scale · B_e(A_e x)`` added to that expert's gate, up and down outputs, as a
per-expert linear layer under PEFT would (float32 products, the sum rounded once to the base's
dtype).

The token-expert pairs are sorted by (expert, adapter span) once, so the base product of each
expert and the LoRA products of each (expert, adapter) run over contiguous rows: one grouped
product per projection where the device has one (``torch._grouped_mm``: CUDA, bfloat16), a
product per non-empty group otherwise. No dense ``ΔW`` is ever formed, and an expert that no
token reached takes part in nothing (its LoRA's gradient is zero).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hosted_tinker.core.routing import Routed
from hosted_tinker.rank.lora_products import add_into, in_dtype, lora_down, products_dtype

_SEPARATE_EXPERT = re.compile(r"(^|\.)experts\.\d+\.")


def separate_expert_linears(model: nn.Module) -> list[str]:
    """Linear layers of ``model`` that are one routed expert's own (``…experts.<e>.…``): such a
    model would get an ordinary 2-D LoRA per expert, not Tinker's 3-D layout (one hidden-side
    factor for every expert), so it is not served. None of transformers 5.24's mixture-of-experts
    classes keeps its experts so (all hold 3-D weights), and no remote code is run here."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and _SEPARATE_EXPERT.search(name)]


IMPLEMENTATION = "hosted_tinker_lora"  # its name in transformers' ALL_EXPERTS_FUNCTIONS
PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down: Tinker's names, in the order adapters are drawn
HOOK_ATTR = "_hosted_tinker_lora"  # on an experts module: its ``ExpertsHook``
COUNTER_ATTR = "_hosted_tinker_routing"  # on an experts module: (its tree's ``RoutingCounter``, its name)
MAX_PADDING = 4  # padded grouped products only while the padded slab is at most this many times the rows


@dataclass(frozen=True)
class ExpertsShape:
    """What LoRA needs to know of one fused experts module."""

    experts: int  # E
    hidden: int  # H
    intermediate: int  # I

    def features(self, projection: str) -> tuple[int, int]:
        """(out, in) of one expert's ``projection``."""
        return (self.hidden, self.intermediate) if projection == "w2" else (self.intermediate, self.hidden)

    def lora_shapes(self, projection: str, rank: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """The shapes of ``projection``'s ``lora_A`` and ``lora_B`` in Tinker's layout: the factor
        on the hidden side one for all experts, the other each expert's own."""
        out_features, in_features = self.features(projection)
        if projection == "w2":  # I -> H: each expert's A, one B
            return (self.experts, rank, in_features), (1, out_features, rank)
        return (1, rank, in_features), (self.experts, out_features, rank)  # H -> I: one A, each expert's B


@dataclass
class ExpertSpan:
    """Tokens [start, end) of the layer's input and their adapter's expert LoRA: per projection
    its ``(A, B)`` (``ExpertsShape.lora_shapes``), absent where the adapter has none."""

    start: int
    end: int
    loras: Mapping[str, tuple[Tensor, Tensor]]
    scale: float


@dataclass(frozen=True)
class ExpertsHook:
    """What ``LoraAdapters`` leaves on an experts module it has put LoRA on."""

    spans: Callable[[int], list[ExpertSpan]]  # tokens of the layer's input -> the spans covering them
    compute: str  # ``--lora-compute``: the dtype of LoRA's products (``lora_products.products_dtype``)


class RoutingCounter:
    """How many tokens each routed expert of each layer receives, per adapter, while ``active``
    (a training pass's forward, not its recomputation in the backward pass): what the service's
    MoE metrics are computed from (``core.routing``); and, with routing replay
    (``rank.routing_replay``), how many of each layer's tokens were replayed and how many of
    those the router would have sent elsewhere. ``segments`` says which tokens run under which
    adapter (``adapters.Routes``)."""

    def __init__(self, segments: Callable[[], list[tuple[int, int | None, str]]]) -> None:
        self.segments = segments
        self.active = False
        self.counts: dict[str, dict[str, Tensor]] = {}  # adapter -> experts module -> (E,) counts
        self.top_k = 1  # experts per token (every layer's the same)
        # adapter -> (replayed, changed) token-layer routings, left on the device
        self.replays: dict[str, Tensor] = {}

    def record(self, module: str, top_k_index: Tensor, experts: int) -> None:
        if not self.active:
            return
        self.top_k = top_k_index.shape[-1]
        for start, end, name in self.segments():
            routed = top_k_index[start:end].reshape(-1)
            counts = torch.bincount(routed, minlength=experts)[:experts]  # stays on the device
            layers = self.counts.setdefault(name, {})
            layers[module] = counts if module not in layers else layers[module] + counts

    def record_replay(self, replayed: Tensor, changed: Tensor) -> None:
        """One layer's replay: per token whether its experts came from the record, and whether
        the router would have chosen others (bool ``(T,)`` each)."""
        if not self.active:
            return
        for start, end, name in self.segments():
            sums = torch.stack([replayed[start:end].sum(), changed[start:end].sum()])
            self.replays[name] = sums if name not in self.replays else self.replays[name] + sums

    def take(self, order: list[str]) -> dict[str, Routed]:
        """Each adapter's routing since the last call: counts ``(layers, experts)`` in ``order``."""
        taken, self.counts = self.counts, {}
        replays, self.replays = self.replays, {}
        out = {}
        for name, layers in taken.items():
            counts = torch.stack([layers[m] for m in order if m in layers]).cpu().numpy()
            replayed, changed = replays[name].tolist() if name in replays else (0, 0)
            out[name] = Routed(counts, int(counts.sum()) // self.top_k, int(replayed), int(changed))
        return out


def fused_experts(module: nn.Module) -> ExpertsShape | None:
    """The shape of ``module`` if it is a fused experts module LoRA can enter (transformers'
    ``@use_experts_implementation`` with a gate), else None."""
    if not hasattr(module, "is_concatenated") or not getattr(module, "has_gate", False):
        return None
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, Tensor) or not isinstance(down, Tensor) or gate_up.dim() != 3:
        return None
    experts, out, hidden = gate_up.shape
    if module.is_transposed:
        experts, hidden, out = gate_up.shape
    return ExpertsShape(experts, hidden, out // 2)


def experts_modules(model: nn.Module) -> dict[str, ExpertsShape]:
    """Every fused experts module of ``model`` by name, in module order."""
    return {name: shape for name, m in model.named_modules() if (shape := fused_experts(m)) is not None}


def use_lora_experts(model: Any) -> None:  # a transformers model (``set_experts_implementation``)
    """Have ``model``'s experts modules run ``lora_experts_forward`` (a no-op for a model without)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, lora_experts_forward)
    if experts_modules(model):
        model.set_experts_implementation(IMPLEMENTATION)


# ---- grouped products ----------------------------------------------------------------------------


def grouped_linear(x: Tensor, weight: Tensor, counts: list[int]) -> Tensor:
    """Rows of ``x`` ``(S, in)`` in consecutive groups of ``counts``, group ``g`` times
    ``weight[g]`` ``(out, in)``: ``(S, out)``. On a GPU one kernel for all groups (torch's
    grouped GEMM for bfloat16, else a batched one over padded groups), never a launch per
    expert; on a CPU a product per non-empty group (launches are cheap there, padding is not)."""
    if _grouped_mm_runs(x, weight):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    if x.is_cuda and padding_pays(counts):
        return padded_grouped_linear(x, weight, counts)
    parts, start = [], 0
    for g, n in enumerate(counts):
        if n:
            parts.append(F.linear(x[start : start + n], weight[g]))
        start += n
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[-2])


def _grouped_mm_runs(x: Tensor, weight: Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands: bfloat16 on a Hopper or later GPU, each
    row 16-byte aligned (a LoRA of rank 4 is not: its products take the padded path)."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == weight.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device)[0] >= 9
        and x.shape[-1] % 8 == 0
        and weight.shape[-2] % 8 == 0
    )


def padding_pays(counts: list[int]) -> bool:
    """Whether padding every group to the largest costs at most ``MAX_PADDING`` times the rows:
    a batch whose tokens all go to one expert (one tenant can send that) must not make slabs of
    experts × tokens."""
    return len(counts) * max(counts, default=0) <= MAX_PADDING * max(sum(counts), 1)


def padded_grouped_linear(x: Tensor, weight: Tensor, counts: list[int]) -> Tensor:
    """``grouped_linear`` as one batched product: each group's rows copied into a zero-padded
    slab of the largest group's size, ``(G, n, in) @ (G, in, out)``, then gathered back. Costs
    the padding (the routing's imbalance), saves a kernel launch per group."""
    counts_t = torch.tensor(counts, device=x.device)
    group = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts_t)
    slot = torch.arange(x.shape[0], device=x.device) - (counts_t.cumsum(0) - counts_t)[group]
    padded = x.new_zeros(len(counts), max(counts, default=0), x.shape[-1]).index_put((group, slot), x)
    return torch.bmm(padded, weight.transpose(-2, -1))[group, slot]


def _as_out_in(weight: Tensor, transposed: bool) -> Tensor:
    return weight.transpose(-2, -1) if transposed else weight


# ---- the experts' forward pass -----------------------------------------------------------------


def lora_experts_forward(
    experts: Any,  # transformers' fused experts module of the family, read by the attributes they share
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
) -> Tensor:
    """``experts``' output for ``hidden_states`` ``(T, H)`` routed to ``top_k_index`` ``(T, K)``
    with ``top_k_weights``, each token's experts under its own adapter's expert LoRA. Without
    LoRA, the same as transformers' own (the expert outputs weighted and summed in float32)."""
    tokens, top_k = top_k_index.shape
    n_experts = experts.num_experts
    if (counter := getattr(experts, COUNTER_ATTR, None)) is not None:
        counter[0].record(counter[1], top_k_index, n_experts)
    hook: ExpertsHook | None = getattr(experts, HOOK_ATTR, None)
    spans = hook.spans(tokens) if hook is not None else []
    if not any(s.loras for s in spans):
        spans = []  # the base alone
    elif sum(s.end - s.start for s in spans) < tokens:
        # tokens under no adapter: a span of their own without LoRA (never a neighbour's)
        spans = [*spans, ExpertSpan(0, 0, {}, 0.0)]
    n_spans = max(len(spans), 1)

    # (expert, span) of each token-expert pair, pairs in token-major order as top_k_index has them;
    # a span without this layer's LoRA (another tenant's adapter on attention only) keeps its index
    expert_ids = top_k_index.reshape(-1)
    span_of_token = torch.full((tokens,), n_spans - 1, dtype=torch.long, device=hidden_states.device)
    for i, span in enumerate(spans):
        span_of_token[span.start : span.end] = i
    key = expert_ids * n_spans + span_of_token.repeat_interleave(top_k)
    key_sorted, perm = torch.sort(key, stable=True)
    group_counts = torch.bincount(key_sorted, minlength=n_experts * n_spans).tolist()  # one sync per layer
    expert_counts = [sum(group_counts[e * n_spans : (e + 1) * n_spans]) for e in range(n_experts)]
    x = hidden_states[perm // top_k]  # (S, H), sorted
    expert_sorted, span_of_row = key_sorted // n_spans, key_sorted % n_spans
    dtype = products_dtype(hook.compute, x.dtype) if hook is not None else None

    def lora_update(projection: str, inputs: Tensor, by_token: Tensor | None = None) -> Tensor | None:
        """The LoRA update of ``projection`` for the sorted pairs (``inputs``, a row each), or None
        if no span has one. A factor one for all experts runs on ``by_token`` (the same inputs in
        token order: the hidden states) or on the pairs, once per span; each expert's own factor
        runs grouped by (expert, span). Adapters of unequal rank are padded with zeros to the
        largest (the same products; no gradient reaches the padding)."""
        present = [s for s in spans if projection in s.loras]
        if not present:
            return None
        rank = max(s.loras[projection][0].shape[-2] for s in present)

        def padded(span: ExpertSpan) -> tuple[Tensor, Tensor] | None:
            if projection not in span.loras:
                return None
            a, b = span.loras[projection]
            extra = rank - a.shape[-2]
            return in_dtype(F.pad(a, (0, 0, 0, extra)), dtype), in_dtype(F.pad(b, (0, extra)), dtype)

        factors = [padded(span) for span in spans]
        like_a, like_b = next(f for f in factors if f is not None)
        if like_a.shape[0] == 1:  # gate, up: one A for every expert, once per token
            if by_token is None:
                raise ValueError(f"{projection}: a LoRA shared by the experts needs the tokens' hidden states")
            down_by_token = by_token.new_zeros(tokens, rank, dtype=like_a.dtype)
            for span, f in zip(spans, factors, strict=True):
                if f is not None and span.end > span.start:
                    rows = torch.arange(span.start, span.end, device=x.device)
                    down_by_token = down_by_token.index_copy(
                        0, rows, lora_down(by_token[span.start : span.end], f[0][0])
                    )
            down = down_by_token[perm // top_k]
        else:  # down: each expert's A; group (e, s) at e * n_spans + s
            a = torch.stack([f[0] if f is not None else torch.zeros_like(like_a) for f in factors], dim=1)
            down = _grouped_lora_down(inputs, a.flatten(0, 1), group_counts)
        if like_b.shape[0] == 1:  # down: one B for every expert, once per span's rows
            if n_spans == 1:
                update = F.linear(down, like_b[0])
            else:
                update = down.new_zeros(down.shape[0], like_b.shape[-2])
                for i, f in enumerate(factors):
                    if f is not None:
                        rows = (span_of_row == i).nonzero().squeeze(1)
                        update = update.index_copy(0, rows, F.linear(down[rows], f[1][0]))
        else:  # gate, up: each expert's B
            b = torch.stack([f[1] if f is not None else torch.zeros_like(like_b) for f in factors], dim=1)
            update = grouped_linear(down, b.flatten(0, 1), group_counts)
        scales = {span.scale for span in present}  # the other spans' rows are zero whatever their scale
        if len(scales) == 1:
            scale = scales.pop()
            return update if scale == 1.0 else update * scale
        per_span = torch.tensor([span.scale for span in spans], device=x.device, dtype=update.dtype)
        return update * per_span[span_of_row][:, None]

    # gate and up
    gate_up = grouped_linear(x, _as_out_in(experts.gate_up_proj, experts.is_transposed), expert_counts)
    if experts.has_bias:
        gate_up = gate_up + experts.gate_up_proj_bias[expert_sorted]
    gate, up = lora_update("w1", x, hidden_states), lora_update("w3", x, hidden_states)
    if gate is None and up is not None:
        gate = torch.zeros_like(up)
    if up is None and gate is not None:
        up = torch.zeros_like(gate)
    if gate is not None and up is not None:
        paired = torch.cat([gate, up], -1) if experts.is_concatenated else torch.stack([gate, up], -1).flatten(-2)
        gate_up = add_into(gate_up, paired)
    hidden = experts._apply_gate(gate_up)  # (S, I)

    # down
    out = grouped_linear(hidden, _as_out_in(experts.down_proj, experts.is_transposed), expert_counts)
    if experts.has_bias:
        out = out + experts.down_proj_bias[expert_sorted]
    down = lora_update("w2", hidden)
    if down is not None:
        out = add_into(out, down)
    if experts.has_post_expert_norm:
        out = experts.post_expert_norm(out)

    weighted = out * top_k_weights.reshape(-1)[perm, None]
    back = torch.empty_like(perm)
    back[perm] = torch.arange(perm.numel(), device=perm.device)
    return weighted[back].view(tokens, top_k, weighted.shape[-1]).sum(dim=1).to(hidden_states.dtype)


def _grouped_lora_down(x: Tensor, a: Tensor, counts: list[int]) -> Tensor:
    """``x`` (the base's dtype) times each group's ``A`` ``(r, in)``, in A's dtype: the grouped
    form of ``lora_products.lora_down`` (which keeps ``x`` as it came for the backward pass)."""
    if x.is_cuda and padding_pays(counts):
        return padded_grouped_linear(x.to(a.dtype), a, counts)
    parts, start = [], 0
    for g, n in enumerate(counts):
        if n:
            parts.append(lora_down(x[start : start + n], a[g]))
        start += n
    return torch.cat(parts) if parts else x.new_zeros(0, a.shape[-2], dtype=a.dtype)
