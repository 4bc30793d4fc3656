"""LoRA on the routed experts of megatron-core's mixture-of-experts layers, in Tinker's layout.

The layout is the ``peft`` backend's (``rank.experts``): per layer ``<experts>.w1`` (gate),
``.w3`` (up) and ``.w2`` (down), each a 3-D ``lora_A`` and ``lora_B`` whose factor on the
hidden-state side is one for all experts. Under expert parallelism rank ``q`` of ``ep`` holds
experts ``[q·E/ep, (q+1)·E/ep)`` (``convert``), and of each projection the factor that is each
expert's own is split the same way (``ExpertSplit``: dim 0 over the expert-parallel group); the
shared factor is on every rank, its gradient the sum of what each rank's experts give it
(``ExpertShared``: summed over every rank, for each rank runs other experts or other tokens).
The experts are never split over the tensor-parallel group (megatron's expert tensor-parallel
size is 1, its "parallel folding"): under ``tp`` > 1 the attention's tensor-parallel ranks, each
seeing its part of the sequence, hold different experts (``ep`` of them) or copies of them.

megatron's ``SequentialMLP`` runs each local expert as an ``MLP`` over that expert's rows of
the tokens gathered from the whole tensor×expert-parallel group (``allgather`` dispatcher), the
rows in the order its permutation put them. A forward hook on each expert's ``linear_fc1``
(``[gate; up]``) and ``linear_fc2`` adds each row's own adapter's update; which adapter a row
runs under is read from the permutation (``reversed_local_input_permutation_mapping``: the
gathered token of each row) and the gathered tokens' adapters, which ``MoeLora.gather_routes``
all-gathers once per pass. The routing weight megatron multiplies into the intermediate
activations before ``linear_fc2`` scales its LoRA update too (``B_e A_e (p h) = p · B_e A_e h``),
as HF's weighting of the expert's whole output does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hosted_tinker.rank.experts import PROJECTIONS, ExpertsShape, RoutingCounter
from hosted_tinker.rank.lora_products import add_into, in_dtype, lora_down, products_dtype, scaled
from hosted_tinker.rank.model import ExpertShared, ExpertSplit
from hosted_tinker.rank.routing_replay import replay_choice, replay_target

NO_ADAPTER = -1  # a token's adapter number when it runs under none (filler, an adapter-less span)


@dataclass
class ExpertsSite:
    """One MoE layer's routed experts, as this rank holds them."""

    moe: Any  # megatron's MoELayer (untyped)
    module: str  # the HF name of its experts, e.g. model.layers.0.mlp.experts
    shape: ExpertsShape  # all experts', as in the HF model
    first: int  # the global index of this rank's first expert
    local: int  # experts on this rank

    def params_per_rank(self) -> int:
        """LoRA parameters per unit of LoRA rank, all experts' (unsharded, as the quotas size an
        adapter): w1 and w3 each ``H + E·I``, w2 ``E·I + H``."""
        return 3 * (self.shape.hidden + self.shape.experts * self.shape.intermediate)


def experts_sites(gpt: nn.Module, shape: ExpertsShape, ep: int, ep_rank: int) -> dict[str, ExpertsSite]:
    """The routed experts of every MoE layer (DeepSeek's first layers are dense)."""
    local = shape.experts // ep
    return {
        f"{i}.experts": ExpertsSite(layer.mlp, f"model.layers.{i}.mlp.experts", shape, ep_rank * local, local)
        for i, layer in enumerate(gpt.decoder.layers)  # type: ignore[union-attr, arg-type]
        if getattr(layer.mlp, "router", None) is not None  # megatron's MoELayer
    }


@dataclass
class ExpertProjection:
    """One experts projection's LoRA on this rank: ``A`` and ``B`` in Tinker's 3-D layout, the
    factor that is each expert's own holding this rank's experts only."""

    module: str  # Tinker's name, e.g. model.layers.0.mlp.experts.w1
    A: nn.Parameter
    B: nn.Parameter

    @property
    def split_dims(self) -> tuple[ExpertSplit | ExpertShared, ExpertSplit | ExpertShared]:
        """Down's ``A`` is each expert's (split), gate's and up's ``B`` (``ExpertsShape.lora_shapes``);
        the other factor all experts share."""
        return (ExpertSplit(), ExpertShared()) if self.module.endswith(".w2") else (ExpertShared(), ExpertSplit())


def draw_expert_projections(site: ExpertsSite, rank: int, draw: Callable) -> list[ExpertProjection]:
    """w1, w3, w2 of ``site`` drawn whole by ``draw`` (``rank.adapters.draw_expert_lora``, under
    the caller's seeded RNG, in PEFT's order), this rank's experts kept."""
    out = []
    for projection in PROJECTIONS:
        a, b = draw(*site.shape.lora_shapes(projection, rank))
        own = slice(site.first, site.first + site.local)
        a, b = (a[own], b) if projection == "w2" else (a, b[own])
        out.append(ExpertProjection(f"{site.module}.{projection}", nn.Parameter(a), nn.Parameter(b)))
    return out


class MoeLora:
    """The expert hooks of every MoE layer of one ``GPTModel``, and the per-pass state they read:
    the adapter number of every token of the tensor×expert-parallel group (``gather_routes``)."""

    def __init__(
        self,
        sites: dict[str, ExpertsSite],
        adapters: Callable[[str], list[tuple[int, list[ExpertProjection], float]]],
        compute: str,
        group: dist.ProcessGroup | None,
    ) -> None:
        """``adapters(site)``: (number, projections, scale) of each resident adapter with LoRA on
        that site. ``group``: where the dispatcher gathers tokens (None: this rank alone)."""
        self.compute, self.group = compute, group
        self.adapters = adapters
        self.token_adapters = torch.empty(0, dtype=torch.long)  # the group's tokens, as gathered
        self.in_pass: set[int] = set()  # the adapters those tokens run under
        self.routing: RoutingCounter | None = None
        # routing replay (``rank.routing_replay``): this pass's recorded experts of this rank's
        # tokens, ``(T, layers, top_k)``, or None; set by ``replay`` for the pass and its recomputation
        self.target: Tensor | None = None
        self.layers = len(sites)
        self.top_k = 0
        for layer, (name, site) in enumerate(sites.items()):
            self._hook(name, site)
            if site.moe.router is not None:
                self.top_k = site.moe.router.topk
                site.moe.router.router_replay = _Replayer(self, layer)

    def replay(
        self, routing: list[Tensor | None], lengths: list[int], device: torch.device, positions: slice = slice(None)
    ) -> None:
        """Replay ``routing`` in the next pass (``routing_replay.replay_target``), until ``clear``;
        ``positions``: those of the stream this rank's routers see (sequence parallelism)."""
        target = replay_target(routing, lengths, self.layers, self.top_k, device)
        self.target = target[positions] if target is not None else None

    def clear(self) -> None:
        self.target = None

    def gather_routes(self, local: Tensor) -> None:
        """Before a pass: the adapter number of each of this rank's tokens, gathered in the
        dispatcher's order (rank by rank of its group; every rank holds as many tokens)."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            self.token_adapters = local
        else:
            out = local.new_empty(local.shape[0] * dist.get_world_size(self.group))
            dist.all_gather_into_tensor(out, local.contiguous(), group=self.group)
            self.token_adapters = out
        # the hooks look only at these (not every resident adapter: one key's many must not slow
        # every pass), once per pass
        self.in_pass = set(torch.unique(self.token_adapters).tolist()) - {NO_ADAPTER}

    def _hook(self, name: str, site: ExpertsSite) -> None:
        experts, dispatcher = site.moe.experts, site.moe.token_dispatcher
        rows: list[Tensor] = []  # per local expert: the adapter number of each of its rows, this pass

        def route_rows(module: nn.Module, args: tuple) -> None:
            tokens_per_expert = args[1]
            gathered = dispatcher.reversed_local_input_permutation_mapping  # row -> gathered token
            ids = self.token_adapters.to(gathered.device)[gathered]
            rows[:] = list(ids.split(tokens_per_expert.tolist()))

        experts.register_forward_pre_hook(route_rows)
        for j, expert in enumerate(experts.local_experts):
            expert.linear_fc1.register_forward_hook(self._update(name, j, rows, fc1=True))
            expert.linear_fc2.register_forward_hook(self._update(name, j, rows, fc1=False))
        if site.moe.router is not None:
            site.moe.router.register_forward_hook(self._count(site))

    def _update(self, name: str, j: int, rows: list[Tensor], *, fc1: bool):
        """The forward hook on local expert ``j``'s ``linear_fc1`` (gate and up: the shared A,
        this expert's B) or ``linear_fc2`` (down: this expert's A, the shared B)."""

        def add(module: nn.Module, args: tuple, output: tuple[Tensor, Tensor | None]):
            out, bias = output
            ids = rows[j]
            spans = [span for span in self.adapters(name) if span[0] in self.in_pass]
            if not spans or ids.numel() == 0:
                # megatron-core 0.16.1 then adds a biased expert's down bias into this output in
                # place, which autograd forbids where it is the view a one-rank reduce-scatter
                # returns (gpt-oss under sequence parallelism): a copy takes it
                return (out.clone(), bias) if bias is not None and out._is_view() else output
            x, dtype = args[0], products_dtype(self.compute, out.dtype)
            update = out.new_zeros(out.shape, dtype=dtype or torch.float32)
            for number, projections, scale in spans:
                which = (ids == number).nonzero().squeeze(1)
                if which.numel() == 0:
                    continue
                w1, w3, w2 = projections  # PROJECTIONS' order
                h = x[which]
                if fc1:
                    parts = [lora_down(h, in_dtype(p.A[0], dtype)) @ in_dtype(p.B[j], dtype).T for p in (w1, w3)]
                    delta = torch.cat(parts, dim=-1)
                else:
                    delta = lora_down(h, in_dtype(w2.A[j], dtype)) @ in_dtype(w2.B[0], dtype).T
                update = update.index_add(0, which, scaled(delta, scale))
            return add_into(out, update), bias

        return add

    def _count(self, site: ExpertsSite):
        """The router's forward hook: each token's experts to the routing counter (the MoE
        metrics), its routing map (tokens, E) holding exactly top-k of each row."""

        def record(module: nn.Module, args: tuple, output: tuple[Tensor, Tensor]) -> None:
            if self.routing is not None:
                routing_map = output[1]
                top_k = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1)
                self.routing.record(site.module, top_k, site.shape.experts)

        return record


class _Replayer:
    """megatron-core's seam for routing replay (``TopKRouter.router_replay``, which its
    ``topk_routing_with_score_function`` asks for each layer's top-k): the recorded experts where
    this pass has a record, the router's own choice elsewhere, their scores gathered as the
    router's own top-k values would be (then megatron weights them as it weights its own).
    megatron's ``RouterReplay`` replays every token or none, from a process-wide list."""

    def __init__(self, owner: MoeLora, layer: int) -> None:
        self.owner, self.layer = owner, layer

    def get_replay_topk(
        self,
        scores: Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[Tensor, Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor]:
        if default_compute_topk is None:
            raise TypeError("megatron-core passes its top-k function")
        values, indices = default_compute_topk(scores, topk, num_groups, group_topk)
        target = self.owner.target
        if target is None:
            return values, indices
        chosen, on, changed = replay_choice(target[:, self.layer], indices)
        if self.owner.routing is not None:
            self.owner.routing.record_replay(on, changed)
        return torch.where(on[:, None], scores.gather(1, chosen), values), chosen
