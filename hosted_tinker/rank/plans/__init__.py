"""Parallel plans: how the ranks of a group share the Tinker step, and nothing else.

A plan says how a batch is split over ranks (``replicas``: the data-parallel shards, see
``core.sharding``), whether a call succeeded on every rank, how gradients and their norm are
reduced, how a new adapter's weights are made the same everywhere, and how tensors sharded over
a model-parallel group are gathered for export (and split again on load), or made whole on
every rank for an optimizer that needs whole matrices. It also picks the
model it runs on. The Tinker step itself is ``rank.trainer``, written once over any plan.

A plan is one module here that defines ``Plan`` (see ``ParallelPlan``), ``DEVICES`` and
``MODELS`` (where it trains and what, in words), its typed ``--backend-option``s in ``options``
(no torch there: ``serve`` checks them first) named ``Options`` in the plan module, plus one line
in ``PLANS``; ``tests/e2e/test_plans.py`` checks every registered plan against a float64
single-process reference, on the layouts its ``CHECKED_LAYOUTS`` names (``(devices, options)``
pairs; by default two CPU ranks, or one).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from pydantic import ValidationError

from hosted_tinker.core.config import ServerConfig
from hosted_tinker.rank.plans.options import DdpOptions, MegatronOptions, PlanOptions, SingleOptions

if TYPE_CHECKING:  # the CLI imports this module for BACKENDS: no torch for `hosted-tinker keys`
    from torch import Tensor, nn

    from hosted_tinker.rank.model import LoraModel, SplitDim

# --backend NAME -> the module that defines its plan (imported only when that backend is used), and
# its typed --backend-options (``options``: no torch there, so that a wrong option is refused at once)
PLANS: dict[str, tuple[str, type[PlanOptions]]] = {
    "peft": ("hosted_tinker.rank.plans.single", SingleOptions),
    "ddp": ("hosted_tinker.rank.plans.ddp", DdpOptions),
    "megatron": ("hosted_tinker.rank.plans.megatron", MegatronOptions),
}
BACKENDS = tuple(PLANS)


class ParallelPlan(Protocol):
    rank: int
    world_size: int
    replicas: int  # data-parallel replicas: a forward_backward batch is split into this many shards
    device: str  # this rank's

    def build_model(self, model_path: str, *, dtype: str, lora_alpha: float, lora_compute: str) -> LoraModel:
        """The model this plan trains, as this rank holds it (``lora_compute``: ``rank.adapters``)."""
        ...

    def all_succeeded(self, succeeded: bool) -> bool:
        """Whether a call succeeded on every rank (a collective, where there are several)."""
        ...

    def passes(self, count: int) -> int:
        """How many passes a rank runs for its shard of ``count`` micro-batches: the most over the
        ranks whose passes meet inside the layers (expert parallelism: a collective), else its own."""
        ...

    def least(self, value: float) -> float:
        """The least of ``value`` over the ranks whose passes must run the same layers the same
        way (a tensor-parallel group: a collective there; the identity where ranks run alone)."""
        ...

    def shard_failed(self, failed: bool) -> bool:
        """After each pass of a lock-stepped model: whether it ``failed`` on any rank running the
        same shard (a tensor-parallel group under expert parallelism, whose ranks must then all
        run the filler passes that follow a failure); else ``failed``."""
        ...

    def broadcast_initial(self, params: list[nn.Parameter], split_dims: list[SplitDim]) -> None:
        """Make a new adapter's initial weights the same wherever they are replicated."""
        ...

    def reduce_gradients(self, params: list[nn.Parameter], split_dims: list[SplitDim]) -> None:
        """Turn each rank's accumulated ``.grad`` into the whole batch's (a sum: losses are sums)."""
        ...

    def replicas_of(self, split_dim: SplitDim) -> int:
        """How many ranks hold the same part of a parameter split so (its gradient is summed over
        them by ``reduce_gradients``)."""
        ...

    def grad_norm(self, grads: list[Tensor], split_dims: list[SplitDim]) -> Tensor:
        """The global L2 norm of the reduced gradients (a 0-d tensor)."""
        ...

    def gather(self, tensors: dict[str, tuple[Tensor, SplitDim]]) -> dict[str, Tensor] | None:
        """Full copies (on CPU) of ``key -> (local tensor, split dim)`` on rank 0; None elsewhere."""
        ...

    def shard(self, full: Tensor, split_dim: SplitDim) -> Tensor:
        """This rank's part of a full tensor (the inverse of ``gather``)."""
        ...

    def whole(self, t: Tensor, split_dim: SplitDim) -> Tensor:
        """The whole tensor of which ``t`` is this rank's part, on every rank of its model-parallel
        group (a collective where it is sharded; ``t`` itself where it is not)."""
        ...


def plan_module(backend: str) -> ModuleType:
    return importlib.import_module(PLANS[backend][0])


def backend_options(config: ServerConfig) -> PlanOptions:
    """The server's ``--backend-option``s, checked against its plan and devices."""
    return plan_options(config.backend, config.backend_options, config.rank_devices(), config.worker_timeout_s)


def plan_options(backend: str, values: dict[str, str], devices: list[str], worker_timeout_s: float) -> PlanOptions:
    """``--backend-option`` values checked against the plan's options; ``ValueError`` names what
    is wrong and what the plan accepts."""
    if backend not in PLANS:
        raise ValueError(f"--backend {backend!r} is not one of {', '.join(PLANS)}")
    model = PLANS[backend][1]
    try:
        options = model.model_validate(values)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        accepted = ", ".join(model.model_fields)
        raise ValueError(f"--backend-option for {backend}: {problems} (it accepts: {accepted})") from None
    options.check(devices, worker_timeout_s)
    return options
