"""LoRA on megatron-core's tensor-parallel layers, sharded like its base layer and keyed by
PEFT's names, so that its checkpoints are the ``peft`` backend's.

Each HF projection PEFT would wrap (``q_proj``, ..., ``down_proj``, ``lm_head``) gets its own
``A`` (r × in) and ``B`` (out × r), with ``y += scale · B(A x)``, ``scale = alpha / r``:

- on a column-parallel layer (``linear_qkv``, ``linear_fc1``, ``output_layer``) the input is
  whole on every rank: ``A`` is replicated, ``B`` split by output rows like the base weight.
  ``A x`` passes megatron's ``copy_to`` region (identity forward, all-reduce backward) so that
  ``A``'s gradient sums every rank's rows of ``B``.
- on a row-parallel layer (``linear_proj``, ``linear_fc2``) the input is split by features:
  ``A`` is split by its columns, ``B`` replicated; the partial ``A x`` is summed over the
  ranks (``reduce_from``: all-reduce forward, identity backward) before ``B``.
- on a layer every rank holds whole (latent attention's down projections, ``latent``) both are
  whole, and so are their gradients.

The fused layers take their deltas in megatron's layout (``weights``): q, k and v interleaved
query group by query group (with Qwen3.5's output gate, ``[queries; gates; k; v]``); gate then
up; a Gated-DeltaNet layer's q, k and v as this rank's rows of ``in_proj_qkv`` (``hybrid``).
Deltas are added by forward hooks, one per layer, each span of tokens under its own adapter
(several models in one pass); the base modules are never replaced. The output layer is the
exception: it runs as ``TpLora.head``, chunk by chunk of positions, its LoRA update added there.

Tensors are ``[sequence, batch, features]``, as megatron-core passes them. A mixture-of-experts
layer's routed experts take Tinker's 3-D layout instead of ``gate``/``up``/``down`` (``experts``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hosted_tinker.rank.adapters import Routes, checked_compute, draw_expert_lora, draw_lora
from hosted_tinker.rank.experts import ExpertsShape
from hosted_tinker.rank.lora_products import add_into, in_dtype, lora_down, products_dtype, scaled
from hosted_tinker.rank.mcore.convert import HfShape
from hosted_tinker.rank.mcore.experts import (
    NO_ADAPTER,
    ExpertProjection,
    ExpertsSite,
    MoeLora,
    draw_expert_projections,
    experts_sites,
)

COLUMN, ROW, WHOLE = "column", "row", "whole"  # WHOLE: a layer every rank holds whole (``latent``)


@dataclass
class Projection:
    """One HF projection's LoRA on this rank."""

    module: str  # PEFT's module name, e.g. model.layers.0.self_attn.q_proj
    A: nn.Parameter  # (r, in) or, row-parallel, (r, in / tp)
    B: nn.Parameter  # (out / tp, r) or, row-parallel, (out, r)
    kind: str  # COLUMN | ROW | WHOLE

    @property
    def split_dims(self) -> tuple[int | None, int | None]:
        return {COLUMN: (None, 0), ROW: (1, None), WHOLE: (None, None)}[self.kind]


@dataclass
class Site:
    """A megatron layer LoRA attaches to, and the HF projections it fuses."""

    layer: nn.Module
    kind: str
    hf_modules: list[str]  # in megatron's fused order
    in_features: int  # whole
    out_features: list[int]  # whole, per HF projection
    fuse: Callable[[list[Tensor]], Tensor] = field(default=lambda deltas: deltas[0])
    # a column layer whose module gathered its sequence-parallel input once for several layers
    # (``hybrid.GatedDeltaNet``): the input arrives whole, its gradient left each rank's share
    whole_input: bool = False


@dataclass
class Adapter:
    projections: dict[str, list[Any]]  # site name -> its Projections (ExpertProjections), fused order
    scale: float
    number: int  # the same on every rank (adapters are added everywhere in one order): routes tokens by it


def sites(gpt: Any, shape: HfShape, tp: int, ep: int = 1, ep_rank: int = 0) -> dict[str, Site | ExpertsSite]:
    """Every layer LoRA may wrap, by Tinker's groups: ``attn``, ``mlp``, ``unembed``; in the HF
    model's module order (PEFT's, in which adapters are drawn)."""
    out: dict[str, Site | ExpertsSite] = {}
    moe = (
        experts_sites(gpt, ExpertsShape(shape.experts, shape.hidden, shape.moe_ffn), ep, ep_rank)
        if shape.experts
        else {}
    )
    groups = shape.kv_heads // tp  # query groups on this rank
    gated = 2 if shape.attention_gate else 1  # Qwen3.5's q_proj: per head [query; gate]

    def qkv(deltas: list[Tensor]) -> Tensor:  # [s, b, local q | k | v] -> per group [q; k; v]
        q, k, v = (d.unflatten(-1, (groups, -1)) for d in deltas)
        if gated == 2:  # per group [queries; gates], as megatron's output-gated linear_qkv
            q = q.unflatten(-1, (-1, 2, shape.head_dim)).transpose(-3, -2).flatten(-3)
        return torch.cat([q, k, v], dim=-1).flatten(-2)

    for i, layer in enumerate(gpt.decoder.layers):
        hf = f"model.layers.{i}"
        attn, mlp = layer.self_attention, layer.mlp
        if shape.linear(i):
            out.update(_linear_attention_sites(i, attn, shape))
        elif shape.latent is not None:  # latent attention: each projection its own layer (``latent``)
            for name, megatron, n_in, n_out in shape.latent.projections(shape.heads, shape.hidden):
                kind = {"linear_proj": ROW, "linear_q_down_proj": WHOLE, "linear_kv_down_proj": WHOLE}.get(
                    megatron, COLUMN
                )
                site = Site(getattr(attn, megatron), kind, [f"{hf}.self_attn.{name}"], n_in, [n_out])
                out[f"{i}.{ATTENTION_SITES[megatron]}"] = site
        else:
            kv_out = shape.kv_heads * shape.head_dim
            out[f"{i}.qkv"] = Site(
                attn.linear_qkv,
                COLUMN,
                [f"{hf}.self_attn.{p}_proj" for p in "qkv"],
                shape.hidden,
                [gated * shape.heads * shape.head_dim, kv_out, kv_out],
                qkv,
            )
            out[f"{i}.proj"] = Site(
                attn.linear_proj, ROW, [f"{hf}.self_attn.o_proj"], shape.heads * shape.head_dim, [shape.hidden]
            )
        if shape.moe(i):
            out[f"{i}.experts"] = moe[f"{i}.experts"]
            if shape.shared_ffn:  # after the routed experts, as in HF's module order
                out.update(
                    _mlp_sites(
                        f"{i}.shared_",
                        mlp.shared_experts,
                        f"{hf}.mlp.{shape.shared_hf}",
                        shape.hidden,
                        shape.shared_ffn,
                    )
                )
            continue
        out.update(_mlp_sites(f"{i}.", mlp, f"{hf}.mlp", shape.hidden, shape.ffn))
    out["unembed"] = Site(gpt.output_layer, COLUMN, ["lm_head"], shape.hidden, [shape.vocab])
    return out


def _linear_attention_sites(i: int, layer: Any, shape: HfShape) -> dict[str, Site]:
    """A Gated-DeltaNet layer's sites (``hybrid``), in HF's module order: ``out_proj``; Tinker's
    q, k and v of ``in_proj_qkv`` (fused here as this rank's rows of it are: its heads' q, k, v);
    ``in_proj_z``. None on the per-head gates ``in_proj_a`` / ``in_proj_b``, as the service's."""
    assert shape.hybrid is not None
    hf, h = f"model.layers.{i}.linear_attn", shape.hidden
    key, value = shape.hybrid.key_heads * shape.hybrid.key_dim, shape.hybrid.value_heads * shape.hybrid.value_dim
    return {
        f"{i}.proj": Site(layer.out_proj, ROW, [f"{hf}.out_proj"], value, [h]),
        f"{i}.qkv": Site(
            layer.in_proj_qkv,
            COLUMN,
            [f"{hf}.in_proj_{p}" for p in "qkv"],
            h,
            [key, key, value],
            lambda deltas: torch.cat(deltas, dim=-1),
            layer.whole_input,
        ),
        f"{i}.z": Site(layer.in_proj_z, COLUMN, [f"{hf}.in_proj_z"], h, [value], whole_input=layer.whole_input),
    }


def _mlp_sites(prefix: str, mlp: Any, hf: str, hidden: int, ffn: int) -> dict[str, Site]:
    """A gated MLP's two sites (a dense layer's, or the shared experts'): ``[gate; up]``, down."""
    fc1 = Site(
        mlp.linear_fc1,
        COLUMN,
        [f"{hf}.gate_proj", f"{hf}.up_proj"],
        hidden,
        [ffn, ffn],
        lambda deltas: torch.cat(deltas, dim=-1),
    )
    return {f"{prefix}fc1": fc1, f"{prefix}fc2": Site(mlp.linear_fc2, ROW, [f"{hf}.down_proj"], ffn, [hidden])}


# latent attention's sites, by megatron's layer (``latent``)
ATTENTION_SITES = {
    "linear_q_proj": "q",
    "linear_q_down_proj": "q_down",
    "linear_q_up_proj": "q_up",
    "linear_kv_down_proj": "kv_down",
    "linear_kv_up_proj": "kv_up",
    "linear_proj": "proj",
}


def group_of(site_name: str) -> str:
    """Tinker's group of a site: ``attn``, ``mlp`` (experts, shared experts, dense MLPs), ``unembed``."""
    if site_name == "unembed":
        return "unembed"
    return "attn" if site_name.split(".")[1] in ("qkv", "z", *ATTENTION_SITES.values()) else "mlp"


def init_adapter(
    chosen: dict[str, Site | ExpertsSite], rank: int, tp: int, tp_rank: int, seed: int
) -> dict[str, list[Any]]:
    """New LoRA weights for the chosen sites, drawn as PEFT draws them for the same modules in
    the same order (``rank.adapters.draw_lora``), so that a seed starts a model exactly where
    the ``peft`` backend starts it; this rank keeps its shards."""
    projections: dict[str, list[Any]] = {}
    with torch.random.fork_rng(devices=[]):
        # the CPU generator only (it draws on the CPU): torch.manual_seed would also reseed CUDA's
        # for good, which fork_rng(devices=[]) does not restore
        torch.random.default_generator.manual_seed(seed)
        for name, site in chosen.items():
            if isinstance(site, ExpertsSite):
                projections[name] = draw_expert_projections(site, rank, draw_expert_lora)
                continue
            projections[name] = []
            for module, out_features in zip(site.hf_modules, site.out_features, strict=True):
                a, b = draw_lora(site.in_features, out_features, rank)
                if site.kind == COLUMN:
                    b = b.chunk(tp, dim=0)[tp_rank]
                elif site.kind == ROW:
                    a = a.chunk(tp, dim=1)[tp_rank]
                projections[name].append(Projection(module, nn.Parameter(a), nn.Parameter(b), site.kind))
    return projections


def column_delta(x: Tensor, p: Projection, dtype: torch.dtype | None = None) -> Tensor:
    """``x`` in the base model's dtype; the update in ``dtype``, None for the adapter's own
    (``rank.lora_products.lora_down``)."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(lora_down(x, in_dtype(p.A, dtype))) @ in_dtype(p.B, dtype).T


def row_delta(x: Tensor, p: Projection, dtype: torch.dtype | None = None) -> Tensor:
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(lora_down(x, in_dtype(p.A, dtype))) @ in_dtype(p.B, dtype).T


def whole_input_delta(x: Tensor, p: Projection, dtype: torch.dtype | None = None) -> Tensor:
    """A column layer's LoRA on an input its module gathered (``Site.whole_input``): as
    ``column_delta``, but ``x``'s gradient stays this rank's share, as the base layer's does
    (the gather's reduce-scatter sums them all at once), and only ``A``'s is summed over the ranks."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    return lora_down(x, in_dtype(p.A, dtype), shares_over=group) @ in_dtype(p.B, dtype).T


def whole_delta(x: Tensor, p: Projection, dtype: torch.dtype | None = None) -> Tensor:
    """A layer every rank holds whole: its input and output are whole (or, under sequence
    parallelism, gathered and scattered around this), so is its LoRA, whose gradients are then
    the same on every rank of the tensor-parallel group."""
    return lora_down(x, in_dtype(p.A, dtype)) @ in_dtype(p.B, dtype).T


# With sequence parallelism the activations between layers are split by sequence: a column
# layer's input arrives as this rank's positions, a row layer's output leaves as them. The LoRA
# branch gathers its input whole (its gradient then comes back split, not summed: the branch's
# own all-reduce has already made it whole on every rank) and scatters its output, so that every
# LoRA gradient is the whole sequence's on every rank, as without sequence parallelism. Adapters
# are routed by span of the whole sequence (``rank.adapters.Routes``), between the two. A layer
# every rank holds whole (``WHOLE``) does both: its LoRA runs on the whole sequence, the same on
# every rank, and the gradient it gets back is the whole sequence's, gathered from the ranks.


def whole_sequence(x: Tensor) -> Tensor:
    """Sequence-split ``x`` whole on every rank; backward, each rank keeps its own part of the
    gradient (already summed over the ranks by whoever used ``x``)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)


def _this_ranks_positions(x: Tensor) -> Tensor:
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(x)


class TpLora:
    """The adapters on one ``GPTModel``: one forward hook per site (the output layer's aside, see
    ``head``) adds to the base layer's output each span's LoRA update under the adapter
    ``routes`` names for it (tokens are the first dimension of megatron's ``[s, b, h]``)."""

    def __init__(
        self,
        gpt: nn.Module,
        shape: HfShape,
        tp: int,
        sequence_parallel: bool = False,
        compute: str = "float32",
        ep: int = 1,
        ep_rank: int = 0,
        token_group: Any = None,
    ) -> None:
        """``ep``, ``ep_rank``: this rank's routed experts (``convert``); ``token_group``: the
        tensor×expert-parallel group the MoE layers gather tokens over (None: this rank alone)."""
        self.compute = checked_compute(compute)  # LoRA's products in the adapters' float32 or the base's dtype
        self.sites = sites(gpt, shape, tp, ep, ep_rank)
        self.adapters: dict[str, Adapter] = {}
        self.routes = Routes()
        self.sequence_parallel = sequence_parallel
        for name, site in self.sites.items():
            if isinstance(site, Site) and name != "unembed":  # the output layer runs as ``head``, chunk by chunk
                site.layer.register_forward_hook(self._hook(name, site))
        moe = {name: site for name, site in self.sites.items() if isinstance(site, ExpertsSite)}
        self.experts = MoeLora(moe, self._expert_adapters, self.compute, token_group) if moe else None

    def _expert_adapters(self, site: str) -> list[tuple[int, list[ExpertProjection], float]]:
        return [(a.number, a.projections[site], a.scale) for a in self.adapters.values() if site in a.projections]

    def token_adapters(self, total: int) -> Tensor:
        """The adapter number of each of ``total`` tokens as ``routes`` has them (``NO_ADAPTER``
        where none)."""
        numbers = torch.full((total,), NO_ADAPTER, dtype=torch.long)
        for start, end, name in self.routes.segments:
            if (adapter := self.adapters.get(name)) is not None:
                numbers[start:end] = adapter.number
        return numbers

    def head(self, name: str, weight: Tensor) -> Callable[[Tensor], Tensor]:
        """The output layer under adapter ``name`` alone: whole-sequence hidden states ``(C, H)``
        (the same on every rank) to this rank's logits ``(C, V/tp)``, ``weight`` being its
        ``(V/tp, H)`` shard (the embedding's when tied). ``core.logprobs`` calls it chunk by
        chunk, and again for each chunk in the backward pass, so that no rank holds the logits
        of every position at once; what megatron's ``ColumnParallelLinear`` would compute."""
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        adapter = self.adapters.get(name)
        projections = adapter.projections.get("unembed") if adapter is not None else None

        def apply(hidden: Tensor) -> Tensor:
            # identity forward; backward, the input's gradient summed over the vocabulary slices
            logits = copy_to_tensor_model_parallel_region(hidden) @ weight.T
            if projections and adapter is not None:
                (p,) = projections
                dtype = products_dtype(self.compute, hidden.dtype)
                update = scaled(column_delta(hidden, p, dtype), adapter.scale)  # its own copy_to
                logits = add_into(logits, update)
            return logits

        return apply

    def _hook(self, name: str, site: Site):
        delta = (
            whole_input_delta
            if site.whole_input
            else {COLUMN: column_delta, ROW: row_delta, WHOLE: whole_delta}[site.kind]
        )
        gather = self.sequence_parallel and site.kind in (COLUMN, WHOLE) and not site.whole_input
        scatter = self.sequence_parallel and site.kind in (ROW, WHOLE)

        def add_updates(module: nn.Module, args: tuple, output: tuple[Tensor, Tensor | None]):
            out, bias = output
            spans = [(s, e, self.adapters.get(a)) for s, e, a in self.routes.segments]
            if not any(adapter is not None and adapter.projections.get(name) for _, _, adapter in spans):
                return output
            x = whole_sequence(args[0]) if gather else args[0]
            dtype = products_dtype(self.compute, out.dtype)
            updates = []
            for start, end, adapter in spans:
                projections = adapter.projections.get(name) if adapter is not None else None
                if not projections or adapter is None:
                    shape = (x[start:end].shape[0], *x.shape[1:-1], out.shape[-1])  # end None: to the last
                    updates.append(x.new_zeros(shape, dtype=dtype or torch.float32))
                    continue
                updates.append(scaled(site.fuse([delta(x[start:end], p, dtype) for p in projections]), adapter.scale))
            update = torch.cat(updates) if len(updates) > 1 else updates[0]
            # the sum in the update's dtype, rounded once to the output's: peft's arithmetic
            return add_into(out, _this_ranks_positions(update) if scatter else update), bias

        return add_updates
