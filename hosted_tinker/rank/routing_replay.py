"""Routing replay: a mixture-of-experts model's expert choices recorded where it samples, and
replayed where it learns (on the HF path; ``rank.mcore.experts`` does the same on megatron).

Why: sampler and learner compute the same model with different numerics (a KV cache against a
packed forward, other batches, other kernels), and where two experts' scores nearly tie, a
token's top-k flips between them. A flipped choice moves the token's log-prob by far more than
rounding does, and an RL loss that weighs the learner's log-prob against the sampler's (an
importance ratio) reads that as the policy having changed. With the sampler's choices replayed,
the two log-probs differ by numerics alone (Rollout Routing Replay, "R3").

Recording (the embedded sampler, ``rank.generate``): each router call's chosen experts, per MoE
layer; the sampler reads them back per token: a prompt's positions once per request, each
sampled token's when it is fed back (the last sampled token is never fed, so it has none).

Replaying (the learner): per packed token and MoE layer the recorded experts, -1 where there is
no record (there the router chooses as usual). A replayed token's experts are weighted from the
learner's own router logits exactly as the family's router weights its own choice, so the
gradient flows through the weights as it does without replay. transformers 5's routers all
return ``(logits, weights, indices)``; their weightings (``WEIGHTINGS``):

- softmax over all experts, the chosen gathered, renormalised (Qwen3.5/3.6-MoE, Qwen3-VL-MoE;
  Qwen3-MoE if ``norm_topk_prob``);
- softmax over the chosen experts' logits (gpt-oss);
- sigmoid, gathered, renormalised if ``norm_topk_prob``, times ``routed_scaling_factor``
  (DeepSeek-V3, Kimi-K2).

A router of another kind is not replayed (its model records nothing, and the request's
``routing_replayed:mean`` says 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from hosted_tinker.core.routing import NO_EXPERT, RECORD_DTYPE
from hosted_tinker.rank.experts import ExpertsShape, RoutingCounter

TORCH_RECORD_DTYPE: torch.dtype = getattr(torch, RECORD_DTYPE)

Weighting = Callable[[Any, Tensor, Tensor], Tensor]  # (router, logits (T, E), indices (T, K)) -> weights


def _softmax(router: Any, logits: Tensor, indices: Tensor) -> Tensor:
    """Qwen3-MoE's: renormalised over the chosen only under ``norm_topk_prob``."""
    return _softmax_gathered(logits, indices, renormalise=router.norm_topk_prob)


def _softmax_renormalised(router: Any, logits: Tensor, indices: Tensor) -> Tensor:
    """Qwen3.5/3.6-MoE's and Qwen3-VL-MoE's: always renormalised over the chosen."""
    return _softmax_gathered(logits, indices, renormalise=True)


def _softmax_gathered(logits: Tensor, indices: Tensor, *, renormalise: bool) -> Tensor:
    weights = torch.softmax(logits, dtype=torch.float, dim=-1).gather(-1, indices)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def _softmax_of_chosen(router: Any, logits: Tensor, indices: Tensor) -> Tensor:
    """gpt-oss's: a softmax over the chosen experts' logits."""
    return torch.softmax(logits.gather(-1, indices), dim=1, dtype=logits.dtype)


def _sigmoid(router: Any, logits: Tensor, indices: Tensor) -> Tensor:
    """DeepSeek-V3's (Kimi-K2's): sigmoid scores, renormalised under ``norm_topk_prob``, scaled."""
    weights = logits.sigmoid().gather(1, indices)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


# transformers 5's router classes of the families this server trains, by name; each weighting
# is its class's forward after the top-k (tests/unit/rank/test_routing_replay.py holds them to it)
WEIGHTINGS: dict[str, Weighting] = {
    "Qwen3MoeTopKRouter": _softmax,
    "Qwen3_5MoeTopKRouter": _softmax_renormalised,
    "Qwen3VLMoeTextTopKRouter": _softmax_renormalised,
    "GptOssTopKRouter": _softmax_of_chosen,
    "DeepseekV3TopkRouter": _sigmoid,
}


def weighting(router: nn.Module) -> Weighting | None:
    """How ``router`` weights the experts it chooses, or None if it is not a router this module knows."""
    return WEIGHTINGS.get(type(router).__name__)


def find_routers(lm: nn.Module, experts: list[str]) -> list[tuple[Any, Weighting]] | None:
    """Each fused experts module's router (its sibling ``gate`` or ``router``) with its
    weighting, in ``experts``' order; None if any is missing or unknown."""
    found = []
    for name in experts:
        parent = lm.get_submodule(name.rpartition(".")[0])
        router: Any = getattr(parent, "gate", None)
        if not isinstance(router, nn.Module) or isinstance(router, nn.Linear):
            router = getattr(parent, "router", None)
        weigh = weighting(router) if isinstance(router, nn.Module) else None
        if weigh is None:
            return None
        found.append((router, weigh))
    return found


def replay_target(
    routing: list[Tensor | None], lengths: list[int], layers: int, top_k: int, device: torch.device
) -> Tensor | None:
    """The experts to replay in a packed pass, ``RECORD_DTYPE`` ``(T, layers, top_k)`` on
    ``device``: per datum (``lengths[i]`` tokens) its recorded ``routing`` ``(N, layers, top_k)``,
    or ``NO_EXPERT`` throughout for one without; None if no datum has a record (or the model has
    no MoE layer). The gateway checked every record against this model
    (``serving.provenance.check_routing``), so a misfit here is a bug, not a user's mistake."""
    if layers == 0 or all(r is None for r in routing):
        return None
    rows = []
    for r, n in zip(routing, lengths, strict=True):
        if r is not None and tuple(r.shape) != (n, layers, top_k):
            raise ValueError(f"a recorded routing of shape {tuple(r.shape)} for {n} tokens of {layers} x {top_k}")
        rows.append(r if r is not None else torch.full((n, layers, top_k), NO_EXPERT, dtype=TORCH_RECORD_DTYPE))
    return torch.cat(rows).to(device, TORCH_RECORD_DTYPE)


def replay_choice(wanted: Tensor, chosen: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One layer's recorded experts ``wanted`` ``(T, K)`` (``NO_EXPERT`` rows: no record) over its
    router's own ``chosen``: the experts to run, whether each token's came from the record, and
    whether they differ from the router's own."""
    if wanted.shape[0] != chosen.shape[0]:
        raise RuntimeError(f"routing replay: {wanted.shape[0]} tokens recorded, {chosen.shape[0]} routed")
    on = wanted[:, 0] != NO_EXPERT
    run = torch.where(on[:, None], wanted.to(chosen.dtype), chosen)
    changed = on & (run.sort(-1).values != chosen.sort(-1).values).any(-1)
    return run, on, changed


class RouterTape:
    """The routers of one module tree, hooked: while ``recording``, what each call chose is kept
    per layer; while ``target`` is set, its choices are replayed. ``target`` stays set from a
    pass's forward through its backward (layers recomputed there must route as their forward
    did) and is cleared by ``clear`` after it."""

    def __init__(self, lm: nn.Module, experts: dict[str, ExpertsShape], counter: RoutingCounter) -> None:
        routers = find_routers(lm, list(experts)) if experts else None
        self.layers = len(routers) if routers else 0  # 0: nothing to record or replay
        self.top_k = int(routers[0][0].top_k) if routers else 0
        self.counter = counter
        self.target: Tensor | None = None  # (T, layers, top_k), RECORD_DTYPE
        self._select: Callable[[Tensor], Tensor] | None = None
        self._recorded: list[Tensor | None] = []
        for layer, (router, weigh) in enumerate(routers or []):
            router.register_forward_hook(self._hook(layer, weigh))

    # ---- recording (the sampler) ------------------------------------------------------------

    @contextmanager
    def recording(self, select: Callable[[Tensor], Tensor]) -> Iterator[Callable[[], Tensor]]:
        """While inside, each router call's choices ``(tokens, top_k)`` are kept, as ``select``
        cuts them (the rows that record: a decode's other rows are not kept); the function
        yielded gives the last call's, ``(layers, *selected)`` in ``RECORD_DTYPE``."""
        self._select, self._recorded = select, [None] * self.layers
        try:
            yield self._taken
        finally:
            self._select, self._recorded = None, []

    def _taken(self) -> Tensor:
        if any(r is None for r in self._recorded):
            raise RuntimeError("a mixture-of-experts layer was not called in the decoder's forward")
        return torch.stack([r for r in self._recorded if r is not None])

    # ---- replaying (the learner) -------------------------------------------------------------

    def replay(self, routing: list[Tensor | None], lengths: list[int], device: torch.device) -> None:
        """Replay ``routing`` (``replay_target``) in the next forward and its recomputation."""
        self.target = replay_target(routing, lengths, self.layers, self.top_k, device)

    def clear(self) -> None:
        """After a pass's backward (or its forward, without one): nothing held between passes."""
        self.target = None

    def _hook(self, layer: int, weigh: Weighting) -> Callable[[nn.Module, tuple, tuple], tuple | None]:
        def hook(router: nn.Module, args: tuple, output: tuple[Tensor, Tensor, Tensor]) -> tuple | None:
            logits, weights, indices = output
            if self._select is not None:
                self._recorded[layer] = self._select(indices.detach()).to(TORCH_RECORD_DTYPE)
            if self.target is None:
                return None
            chosen, on, changed = replay_choice(self.target[:, layer], indices)
            self.counter.record_replay(on, changed)
            return logits, torch.where(on[:, None], weigh(router, logits, chosen), weights), chosen

        return hook
