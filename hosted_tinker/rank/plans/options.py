"""Each parallel plan's typed ``--backend-option``s, and the options every plan has.

Apart from the plans themselves (which import torch), so that ``serve`` checks a server's options,
and refuses a wrong one in a line, before anything heavy is imported; a plan module names its
own as ``Options`` (``rank.plans.PLANS`` pairs each backend with its class here).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Annotated, Literal

from packaging.specifiers import SpecifierSet
from pydantic import BaseModel, ConfigDict, Field, model_validator

# The releases rank.mcore is built on and tested with (as pyproject's extra pins): 0.17 changed the
# layer specs it reads, and pip gives Python 3.12 the newest unless told.
MCORE_SUPPORTED = SpecifierSet(">=0.16.1,<0.17")


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


class SingleOptions(PlanOptions):
    synthetic: bool = Field(
        False,
        description="benchmarks only (benchmarks/gateway_scale.py): forward_backward answers log-probs of the "
        "right shapes at once, without running the model; the results are not training",
    )

    def check(self, devices: list[str], worker_timeout_s: float) -> None:
        super().check(devices, worker_timeout_s)
        if len(devices) != 1:
            raise ValueError(f"the peft backend trains on one device, not {len(devices)}; use --backend ddp")


class DdpOptions(PlanOptions):
    collective_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="how long a rank waits for the others (to join, or in a collective) before the group is replaced",
    )

    def check(self, devices: list[str], worker_timeout_s: float) -> None:
        super().check(devices, worker_timeout_s)
        if self.collective_timeout_s >= worker_timeout_s:
            # A hung rank must be caught by the collective that waits for it, which names it.
            raise ValueError(
                f"--backend-option collective_timeout_s={self.collective_timeout_s:g} must be below "
                f"--worker-timeout ({worker_timeout_s:g} s)"
            )


class MegatronOptions(DdpOptions):
    tp: int = Field(1, ge=1, description="tensor-parallel size: ranks that share one copy of the model")
    ep: int = Field(
        1,
        ge=1,
        description="expert-parallel size: ranks over which a mixture-of-experts model's routed experts are "
        "split, each running its own tokens; it divides the ranks, as tp does (the experts are not split "
        "over tp's ranks, which hold different experts under ep > 1)",
    )
    sequence_parallel: bool = Field(
        False, description="split the activations between the parallel layers by sequence (needs tp > 1)"
    )
    layers: Literal["auto", "te", "local"] = Field(
        "auto",
        description="transformer-engine layers (te, CUDA only) or megatron-core's PyTorch ones (local); "
        "auto: te when transformer_engine is installed, the ranks are on GPUs and --dtype is 16-bit",
    )
    embedded_sampler: bool = Field(
        True,
        description="rank 0 also loads the whole HF base model for the embedded sampler (off: sample with "
        "--inference vllm, where prompt logprobs are then refused)",
    )

    def check(self, devices: list[str], worker_timeout_s: float) -> None:
        super().check(devices, worker_timeout_s)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("--backend-option sequence_parallel=true needs tp > 1")
        for name, size in (("tp", self.tp), ("ep", self.ep)):
            if len(devices) % size:
                raise ValueError(
                    f"--backend-option {name}={size} does not divide the {len(devices)} ranks of --train-devices"
                )
        if self.ep % self.tp and self.tp % self.ep:
            # a tensor-parallel group (one shard) would straddle two expert-parallel groups, whose
            # passes are padded and counted apart: its ranks would run unequal passes
            raise ValueError(f"--backend-option tp={self.tp} and ep={self.ep}: one must divide the other")
        if self.ep > 1 and self.activation_memory_gib is not None:
            # what a stored layer keeps is measured per rank, on passes of unequal length: the
            # lock-stepped ranks would choose apart
            raise ValueError(
                "--backend-option activation_memory_gib is not built for ep > 1: give recompute_above_tokens"
            )
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            # Found, not imported: the server process never loads megatron-core, only its ranks.
            raise ValueError("the megatron backend needs megatron-core: pip install 'hosted-tinker[megatron]'")
        try:
            found = importlib.metadata.version("megatron-core")
        except importlib.metadata.PackageNotFoundError:  # importable, but not installed by pip (a checkout)
            raise ValueError(
                f"megatron.core is importable but no megatron-core package is installed: "
                f"pip install 'megatron-core{MCORE_SUPPORTED}'"
            ) from None
        if found not in MCORE_SUPPORTED:
            raise ValueError(
                f"the megatron backend runs on megatron-core {MCORE_SUPPORTED}, not the installed {found}: "
                f"pip install 'megatron-core{MCORE_SUPPORTED}'"
            )
        if self.layers == "te":
            if not all(d.startswith("cuda") for d in devices):
                raise ValueError("--backend-option layers=te needs GPU ranks (transformer-engine runs on CUDA only)")
            if not has_transformer_engine():
                raise ValueError("--backend-option layers=te needs transformer-engine: pip install transformer-engine")

    def activation_budget(
        self, devices: list[str] | tuple[str, ...], shares_gpu: bool = False
    ) -> float | Literal["auto"] | None:
        """As every plan's, except under expert parallelism: the token threshold decides there
        (``check`` refuses a budget)."""
        return None if self.ep > 1 else super().activation_budget(devices, shares_gpu)

    def uses_te(self, device: str, dtype: str, te_layers: bool = True) -> bool:
        """Whether a rank on ``device`` builds transformer-engine layers for a ``dtype`` base.
        ``auto`` leaves a float32 base on the local layers: TE's fused and flash attention take
        16-bit inputs only, and its speed is in those kernels; and a model for which no TE layers
        are built (not ``te_layers``: latent or linear attention; ``te`` is refused for it, naming it)."""
        if self.layers == "auto":
            return (
                device.startswith("cuda")
                and dtype in ("bfloat16", "float16")
                and te_layers
                and has_transformer_engine()
            )
        return self.layers == "te"


def has_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None
