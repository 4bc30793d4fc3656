"""Tensor parallelism on megatron-core: ``tp`` consecutive ranks share one copy of the model,
each holding ``1/tp`` of every attention, MLP, embedding and output layer and of the LoRA on
them (``rank.mcore``); the ``world / tp`` such groups are data-parallel replicas, as in ``ddp``.

The ranks of a tensor-parallel group run the same shard of a batch (the server gives
consecutive ranks the same replica's shard) and meet inside every layer; the plan's own
collectives are ``ddp``'s, over the replica group of this rank's tensor-parallel position
(gradients summed, initial weights broadcast), plus:

- the gradient norm: squares of sharded gradients summed over the tensor-parallel group,
  replicated ones counted once;
- export and load: sharded tensors gathered over the tensor-parallel group into whole PEFT
  tensors on rank 0, and split again on load, so checkpoints are the ``peft`` backend's.

megatron-core is an optional extra (``pip install hosted-tinker[megatron]``), imported only here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Literal

import torch
import torch.distributed as dist
from packaging.specifiers import SpecifierSet
from pydantic import Field
from torch import Tensor

from hosted_tinker.rank.plans import ddp

DEVICES = "tp x dp ranks: --train-devices cpu:N | cuda:0,1,...; --backend-option tp=N"
# The releases rank.mcore is built on and tested with (as pyproject's extra pins): 0.17 changed the
# layer specs it reads, and pip gives Python 3.12 the newest unless told.
MCORE_SUPPORTED = SpecifierSet(">=0.16.1,<0.17")
# tests/e2e/test_plans.py: tensor-parallel alone, with sequence parallelism, with two data-parallel
# replicas that recompute every layer's activations, and with a memory budget that stores some.
CHECKED_LAYOUTS = [
    ("cpu:2", {"tp": "2"}),
    ("cpu:2", {"tp": "2", "sequence_parallel": "true"}),
    ("cpu:4", {"tp": "2", "recompute_above_tokens": "0"}),
    ("cpu:2", {"tp": "2", "activation_memory_gib": "0.0005", "microbatch_tokens": "48"}),
]


class Options(ddp.Options):
    tp: int = Field(1, ge=1, description="tensor-parallel size: ranks that share one copy of the model")
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
        if len(devices) % self.tp:
            raise ValueError(
                f"--backend-option tp={self.tp} does not divide the {len(devices)} ranks of --train-devices"
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

    def uses_te(self, device: str, dtype: str) -> bool:
        """Whether a rank on ``device`` builds transformer-engine layers for a ``dtype`` base.
        ``auto`` leaves a float32 base on the local layers: TE's fused and flash attention take
        16-bit inputs only, and its speed is in those kernels."""
        if self.layers == "auto":
            return device.startswith("cuda") and dtype in ("bfloat16", "float16") and has_transformer_engine()
        return self.layers == "te"


def has_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


class Plan(ddp.Plan):
    def __init__(self, rank: int, devices: list[str], init_method: str, options: Options) -> None:
        super().__init__(rank, devices, init_method, options)
        from hosted_tinker.rank import mcore

        mcore.quiet()
        from megatron.core import parallel_state

        self.tp = options.tp
        self.embedded_sampler = options.embedded_sampler and rank == 0
        self.sequence_parallel = options.sequence_parallel
        self.uses_te = options.uses_te  # decided per model: it depends on the base's dtype
        self.tp_rank = rank % self.tp
        self.replicas = self.world_size // self.tp
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            # its groups time out as the world group does (a timedelta of these minutes), not in 30 min
            distributed_timeout_minutes=options.collective_timeout_s / 60,
        )
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.replica_group = parallel_state.get_data_parallel_group()

    def build_model(self, model_path: str, *, dtype: str, lora_alpha: float, lora_compute: str):
        from hosted_tinker.rank.mcore.model import McoreLoraModel

        return McoreLoraModel(
            model_path,
            tp=self.tp,
            tp_rank=self.tp_rank,
            device=self.device,
            dtype=dtype,
            lora_alpha=lora_alpha,
            lora_compute=lora_compute,
            sampler_base=self.embedded_sampler,
            sequence_parallel=self.sequence_parallel,
            te=self.uses_te(self.device, dtype),
        )

    def least(self, value: float) -> float:
        if self.tp == 1:
            return value
        with ddp._collective("the tensor-parallel group's agreement on which layers to recompute"):
            t = torch.tensor([value], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_group)
            return float(t.item())

    def grad_norm(self, grads: list[Tensor], split_dims: list[int | None]) -> Tensor:
        squares = torch.zeros(2, dtype=torch.float64, device=self.device)  # [sharded, replicated]
        for g, dim in zip(grads, split_dims, strict=True):
            squares[0 if dim is not None else 1] += g.double().pow(2).sum()
        if self.tp > 1:
            with ddp._collective("the gradient norm's all-reduce"):
                sharded = squares[:1].clone()
                dist.all_reduce(sharded, group=self.tp_group)
                squares = torch.cat([sharded, squares[1:]])
        return squares.sum().sqrt().float().cpu()

    def gather(self, tensors: dict[str, tuple[Tensor, int | None]]) -> dict[str, Tensor] | None:
        with ddp._collective("export's gather over the tensor-parallel group"):
            whole = {key: self._all_gather(t, dim).detach().cpu().clone() for key, (t, dim) in tensors.items()}
        return whole if self.rank == 0 else None

    def whole(self, t: Tensor, split_dim: int | None) -> Tensor:
        with ddp._collective("a whole matrix's gather over the tensor-parallel group"):
            return self._all_gather(t, split_dim)

    def _all_gather(self, t: Tensor, split_dim: int | None) -> Tensor:
        if split_dim is None or self.tp == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=split_dim)

    def shard(self, full: Tensor, split_dim: int | None) -> Tensor:
        return full if split_dim is None else full.chunk(self.tp, dim=split_dim)[self.tp_rank]
