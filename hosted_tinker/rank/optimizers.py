"""The optimizer families a model can be created with, as the trainer steps them.

Each keeps its per-parameter state in ``state[p]`` (a dict of tensors shaped like ``p`` or
scalars; export and load move it as ``<key>.<field>``, ``STATE_FIELDS``) and takes one step from
gradients the trainer has already reduced over the ranks and clipped, then clears them. A
parameter without a gradient is left alone, state included, as ``torch.optim`` does.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

from hosted_tinker.core import dimuon
from hosted_tinker.core.types import AdamParams, DimuonParams, OptimParams

if TYPE_CHECKING:
    from hosted_tinker.rank.model import SplitDim


class Optimizer(Protocol):
    family: str
    STATE_FIELDS: tuple[str, ...]

    @property
    def state(self) -> MutableMapping[Tensor, dict[str, Tensor]]: ...  # the trainer fills it on a load

    def step(self, params: OptimParams) -> None: ...


class WholeTensors(Protocol):
    """What Dimuon needs of the parallel plan: matrices whole wherever they are sharded."""

    def whole(self, t: Tensor, split_dim: SplitDim) -> Tensor: ...

    def shard(self, full: Tensor, split_dim: SplitDim) -> Tensor: ...


class AdamW:
    """``torch.optim.AdamW``, its hyperparameters set from each step's ``AdamParams``."""

    family = "adamw"
    STATE_FIELDS: tuple[str, ...] = ("step", "exp_avg", "exp_avg_sq")

    def __init__(self, params: list[nn.Parameter]) -> None:
        self._torch = torch.optim.AdamW(params, lr=0.0, foreach=False)

    @property
    def state(self) -> MutableMapping[Tensor, dict[str, Tensor]]:
        return self._torch.state

    def step(self, params: OptimParams) -> None:
        assert isinstance(params, AdamParams)
        for group in self._torch.param_groups:
            group.update(
                lr=params.learning_rate,
                betas=(params.beta1, params.beta2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
        self._torch.step()
        self._torch.zero_grad(set_to_none=True)


class Dimuon:
    """``core.dimuon``'s update on every LoRA matrix. A matrix sharded over a model-parallel
    group is made whole for the direction (every rank of the group computes the same one) and
    each rank applies its own part; the momentum stays sharded like the weight."""

    family = "dimuon"
    STATE_FIELDS: tuple[str, ...] = ("momentum",)

    def __init__(self, params: list[nn.Parameter], split_dims: list[SplitDim], rank: int, plan: WholeTensors) -> None:
        self.params, self.split_dims, self.rank, self.plan = params, split_dims, rank, plan
        self.state: dict[Tensor, dict[str, Tensor]] = {}

    @torch.no_grad()
    def step(self, params: OptimParams) -> None:
        assert isinstance(params, DimuonParams)
        lr = params.learning_rate * dimuon.rank_correction(self.rank, params.rank_lr_correction_exponent)
        for p, dim in zip(self.params, self.split_dims, strict=True):
            if p.grad is None:
                continue
            if p not in self.state:  # float32 at least: a bf16 momentum would lose small gradients
                self.state[p] = {"momentum": torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))}
            m = self.state[p]["momentum"]
            m.mul_(params.beta1).add_(p.grad, alpha=1 - params.beta1)
            d = dimuon.direction(self.plan.whole(m, dim), rank=self.rank, damping=params.damping)
            p.sub_(self.plan.shard(d, dim).to(p.dtype), alpha=lr)
            p.grad = None


def create(
    family: str, params: list[nn.Parameter], split_dims: list[SplitDim], rank: int, plan: WholeTensors
) -> Optimizer:
    if family == "dimuon":
        return Dimuon(params, split_dims, rank, plan)
    return AdamW(params)
