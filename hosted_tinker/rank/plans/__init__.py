"""Parallel plans: how the ranks of a group share the Tinker step, and nothing else.

A plan says how a batch is split over ranks (``replicas``: the data-parallel shards, see
``core.sharding``), whether a call succeeded on every rank, how gradients and their norm are
reduced, how a new adapter's weights are made the same everywhere, and how tensors sharded over
a model-parallel group are gathered for export (and split again on load), or made whole on
every rank for an optimizer that needs whole matrices. It also picks the
model it runs on. The Tinker step itself is ``rank.trainer``, written once over any plan.

A plan is one module here that defines ``Plan`` (see ``ParallelPlan``), ``Options`` (its
typed ``--backend-option``s) and ``DEVICES`` (where it trains, in words), plus one line in
``PLANS``; ``tests/e2e/test_plans.py`` checks every registered plan against a float64
single-process reference, on the layouts its ``CHECKED_LAYOUTS`` names (``(devices, options)``
pairs; by default two CPU ranks, or one).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hosted_tinker.core.config import ServerConfig

if TYPE_CHECKING:  # the CLI imports this module for BACKENDS: no torch for `hosted-tinker keys`
    from torch import Tensor, nn

    from hosted_tinker.rank.model import LoraModel, SplitDim

# --backend NAME -> the module that defines its plan (imported only when that backend is used).
PLANS: dict[str, str] = {
    "peft": "hosted_tinker.rank.plans.single",
    "ddp": "hosted_tinker.rank.plans.ddp",
    "megatron": "hosted_tinker.rank.plans.megatron",
}
BACKENDS = tuple(PLANS)


class PlanOptions(BaseModel):
    """Options every plan has; a plan's ``Options`` adds its own."""

    model_config = ConfigDict(extra="forbid")

    microbatch_tokens: int = Field(16384, ge=1, description="tokens per forward/backward micro-batch (packed)")
    recompute_above_tokens: int = Field(
        8192,
        ge=0,
        description="recompute each decoder layer's activations in the backward pass when a micro-batch holds more "
        "tokens than this (0: always; at least microbatch_tokens: only for a longer single sequence); the rule "
        "on CPU ranks, and on GPU ranks when given (else activation_memory_gib=auto)",
    )
    activation_memory_gib: Annotated[float, Field(gt=0, allow_inf_nan=False)] | Literal["auto"] | None = Field(
        None,
        description="instead of recompute_above_tokens: the memory a micro-batch's stored activations may take; "
        "it recomputes as few of the first decoder layers as keep the others within it (auto: what the GPU has "
        "free at that moment, less a margin, the least over a tensor-parallel group; GPU ranks only, and their "
        "default unless recompute_above_tokens is given or a vLLM launched by the server shares their GPU)",
    )

    @model_validator(mode="after")
    def _one_recompute_rule(self) -> PlanOptions:
        if self.activation_memory_gib is not None and "recompute_above_tokens" in self.model_fields_set:
            raise ValueError("give activation_memory_gib or recompute_above_tokens, not both: each decides alone")
        return self

    def activation_budget(
        self, devices: list[str] | tuple[str, ...], shares_gpu: bool = False
    ) -> float | Literal["auto"] | None:
        """The memory budget of a micro-batch's stored activations, in bytes, ``"auto"`` or None
        (None: the token threshold, ``recompute_above_tokens``, decides). GPU ranks given neither
        option budget ``auto``: the threshold is blind to the model and the card (Qwen3-8B's shape
        stores ~7.5 MB per token: an 8,192-token micro-batch, under the threshold, needs ~62 GB
        beside the weights, more than an H100 has), and on an H200 at 4 x 4,096 tokens ``auto``
        stored 32 of 36 layers where the threshold recomputes all, 1.30x the tokens per second.
        Not where a GPU ``shares_gpu`` with a vLLM this server launches: what ``auto`` takes, the
        allocator keeps, and a vLLM (re)starting beside it would not find its share."""
        if isinstance(self.activation_memory_gib, float):
            return self.activation_memory_gib * 2**30
        if self.activation_memory_gib is None and "recompute_above_tokens" not in self.model_fields_set:
            on_gpus = bool(devices) and all(d.startswith("cuda") for d in devices)
            return "auto" if on_gpus and not shares_gpu else None
        return self.activation_memory_gib

    def check(self, devices: list[str], worker_timeout_s: float) -> None:
        """Raise ``ValueError`` if these options cannot run on ``devices`` (checked at start-up);
        a plan's ``Options`` that adds checks calls this first."""
        if self.activation_memory_gib == "auto" and not all(d.startswith("cuda") for d in devices):
            raise ValueError(
                "--backend-option activation_memory_gib=auto needs GPU ranks (it reads the GPU's free memory); "
                "give a number of GiB on CPU ranks"
            )


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
    return importlib.import_module(PLANS[backend])


def backend_options(config: ServerConfig) -> PlanOptions:
    """The server's ``--backend-option``s, checked against its plan and devices."""
    return plan_options(config.backend, config.backend_options, config.rank_devices(), config.worker_timeout_s)


def plan_options(backend: str, values: dict[str, str], devices: list[str], worker_timeout_s: float) -> PlanOptions:
    """``--backend-option`` values checked against the plan's options; ``ValueError`` names what
    is wrong and what the plan accepts."""
    if backend not in PLANS:
        raise ValueError(f"--backend {backend!r} is not one of {', '.join(PLANS)}")
    model: type[PlanOptions] = plan_module(backend).Options
    try:
        options = model.model_validate(values)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        accepted = ", ".join(model.model_fields)
        raise ValueError(f"--backend-option for {backend}: {problems} (it accepts: {accepted})") from None
    options.check(devices, worker_timeout_s)
    return options
