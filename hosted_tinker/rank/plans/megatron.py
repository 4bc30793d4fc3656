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

With ``ep`` > 1 a mixture-of-experts model's routed experts are split over ``ep`` consecutive
ranks (megatron's expert parallelism), each running its own tokens: its replica's shard of a
batch, and under ``tp`` > 1 its part of that shard's sequence (sequence parallelism, which
megatron's MoE layer needs there; the experts themselves are never split over the
tensor-parallel group: expert tensor-parallel size 1, megatron's "parallel folding", so ``tp``
and ``ep`` each divide the ranks). They meet in every MoE layer, so their passes run in lock
step (``passes``, ``least``: the same count, the same layers recomputed); the experts' own LoRA
factors (``ExpertSplit``) are gathered over the expert-parallel group on export, and their
gradients summed over the ranks that hold the same experts (megatron's expert-data-parallel
group); the factors all experts share (``ExpertShared``) over every rank.

megatron-core is an optional extra (``pip install hosted-tinker[megatron]``), imported only here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hosted_tinker.rank.mcore.convert import ARCHS, MOE_ARCHS
from hosted_tinker.rank.model import ExpertShared, ExpertSplit, SplitDim
from hosted_tinker.rank.plans import ddp
from hosted_tinker.rank.plans.options import MegatronOptions as Options

DEVICES = "tp x dp ranks, a multiple of ep: --train-devices cpu:N | cuda:0,1,...; --backend-option tp=T ep=E"
MODELS = (
    f"{', '.join(ARCHS)} (rank.mcore.convert); ep > 1 for {', '.join(MOE_ARCHS)}, "
    "whose tp > 1 needs sequence_parallel=true"
)
# tests/e2e/test_plans.py, on the tiny dense model: tensor-parallel with sequence parallelism, and
# without it under a memory budget that stores some layers' activations.
CHECKED_LAYOUTS = [
    ("cpu:2", {"tp": "2", "sequence_parallel": "true"}),
    ("cpu:2", {"tp": "2", "activation_memory_gib": "0.0005", "microbatch_tokens": "48"}),
]
# The same on the tiny mixture-of-experts models (Qwen3-MoE's, unless a third element names
# another family): the experts split over two ranks (on the tiny gpt-oss: attention sinks,
# sliding windows, YaRN, biases on every linear layer, a clamped SwiGLU), and over two ranks
# twice (two copies of each expert, whose gradients are summed; attention's replicas too), with
# small micro-batches so that the ranks' shards hold unequal numbers of them; under tensor
# parallelism (split by sequence), every expert on both ranks of the group, every layer's
# activations recomputed (on the tiny Qwen3.5-MoE: Gated-DeltaNet layers split by heads,
# output-gated attention, a gated shared expert), the experts split over those two ranks (on the
# tiny DeepSeek-V3: latent attention, a dense first layer, shared experts, grouped sigmoid
# routing with a bias), and over four ranks that are two tensor-parallel groups (two replicas'
# shards meeting in the MoE layers).
CHECKED_MOE_LAYOUTS: list[tuple] = [
    ("cpu:2", {"ep": "2"}, "gpt_oss"),
    ("cpu:4", {"ep": "2", "microbatch_tokens": "48"}),
    ("cpu:2", {"tp": "2", "sequence_parallel": "true", "recompute_above_tokens": "0"}, "qwen3_5_moe"),
    ("cpu:2", {"tp": "2", "ep": "2", "sequence_parallel": "true"}, "deepseek_v3"),
    ("cpu:4", {"tp": "2", "ep": "4", "sequence_parallel": "true", "microbatch_tokens": "48"}),
]


class Plan(ddp.Plan):
    def __init__(self, rank: int, devices: list[str], init_method: str, options: Options) -> None:
        super().__init__(rank, devices, init_method, options)
        from hosted_tinker.rank import mcore

        mcore.quiet()
        from megatron.core import parallel_state

        self.tp, self.ep = options.tp, options.ep
        self.embedded_sampler = options.embedded_sampler and rank == 0
        self.sequence_parallel = options.sequence_parallel
        self.uses_te = options.uses_te  # decided per model: it depends on the base's dtype
        self.tp_rank = rank % self.tp
        self.replicas = self.world_size // self.tp
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=1,  # experts whole on their ranks (``rank.mcore.experts``)
            # its groups time out as the world group does (a timedelta of these minutes), not in 30 min
            distributed_timeout_minutes=options.collective_timeout_s / 60,
        )
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.replica_group = parallel_state.get_data_parallel_group()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        self.expert_replica_group = parallel_state.get_expert_data_parallel_group()  # the same experts
        # where a MoE layer's dispatcher gathers tokens: the expert-parallel group (its expert
        # tensor-parallel size is 1)
        self.token_group = parallel_state.get_expert_tensor_and_model_parallel_group()
        # The ranks that must run as many passes, recomputing the same layers: a tensor-parallel
        # group (one shard, split inside the layers) and, under ep > 1, an expert-parallel group
        # (they meet in the MoE layers). ``tp`` and ``ep`` nest (``MegatronOptions.check``), so
        # the larger group holds the smaller: it is the one to agree over.
        self.lock_group = self.tp_group if self.tp >= self.ep else self.token_group

    def build_model(self, model_path: str, *, dtype: str, lora_alpha: float, lora_compute: str):
        from hosted_tinker.rank.mcore.convert import HfShape
        from hosted_tinker.rank.mcore.model import McoreLoraModel

        shape = HfShape.read(model_path)  # read once: the model takes it too

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
            te=self.uses_te(self.device, dtype, te_layers=shape.te_layers),
            shape=shape,
            ep=self.ep,
            ep_rank=self.ep_rank,
            token_group=self.token_group,
        )

    def passes(self, count: int) -> int:
        if self.ep <= self.tp:
            return count  # the lock group is a tensor-parallel group, whose ranks run one shard
        return int(self._over_lock_group(count, dist.ReduceOp.MAX, "the expert-parallel group's count of passes"))

    def least(self, value: float) -> float:
        if self.tp * self.ep == 1:
            return value
        return self._over_lock_group(value, dist.ReduceOp.MIN, "the group's agreement on which layers to recompute")

    def shard_failed(self, failed: bool) -> bool:
        if self.tp == 1 or self.ep == 1:
            return failed  # one rank a shard, or ranks that never run lock-stepped filler passes
        with ddp.collective("the tensor-parallel group's agreement on a failed pass"):
            flag = torch.tensor([float(failed)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.tp_group)
            return bool(flag.item())

    def _over_lock_group(self, value: float, op: dist.ReduceOp.RedOpType, what: str) -> float:
        with ddp.collective(what):
            t = torch.tensor([value], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=op, group=self.lock_group)
            return float(t.item())

    def _by_group(
        self, params: list[nn.Parameter], split_dims: list[SplitDim]
    ) -> list[tuple[list[nn.Parameter], dist.ProcessGroup | None]]:
        """``params`` by the ranks that hold the same part of them: the replicas of this rank's
        tensor-parallel position; the ranks with the same experts (``ExpertSplit``); every rank
        (``ExpertShared``: None, the world)."""
        groups: list[tuple[type | None, dist.ProcessGroup | None]] = [
            (None, self.replica_group),
            (ExpertSplit, self.expert_replica_group),
            (ExpertShared, None),
        ]
        kind = [type(d) if isinstance(d, ExpertSplit | ExpertShared) else None for d in split_dims]
        return [([p for p, k in zip(params, kind, strict=True) if k is want], group) for want, group in groups]

    def broadcast_initial(self, params: list[nn.Parameter], split_dims: list[SplitDim]) -> None:
        for held, group in self._by_group(params, split_dims):
            self.broadcast(held, group)

    def reduce_gradients(self, params: list[nn.Parameter], split_dims: list[SplitDim]) -> None:
        (dense, replicas), (own, same_experts), (shared, everyone) = self._by_group(params, split_dims)
        self.sum_gradients(dense, replicas)
        self.sum_gradients(own, same_experts)
        self._gradient_everywhere(own)
        self.sum_gradients(shared, everyone)

    def _gradient_everywhere(self, params: list[nn.Parameter]) -> None:
        """An expert-split factor whose slice has a gradient on some rank of the expert-parallel
        group gets a zero one on the others (no token of the adapter reached their experts): as
        on peft, where the 3-D tensor has one gradient or none, and so that every rank steps,
        exports and gathers the same tensors."""
        if not params or self.ep == 1:
            return
        with ddp.collective("the expert-parallel group's agreement on which gradients exist"):
            has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=self.device)
            dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.ep_group)
            anywhere = has.tolist()
        for p, present in zip(params, anywhere, strict=True):
            if present and p.grad is None:
                p.grad = torch.zeros_like(p)

    def replicas_of(self, split_dim: SplitDim) -> int:
        if isinstance(split_dim, ExpertShared):
            return self.world_size
        return dist.get_world_size(self.expert_replica_group) if isinstance(split_dim, ExpertSplit) else self.replicas

    def grad_norm(self, grads: list[Tensor], split_dims: list[SplitDim]) -> Tensor:
        # [split over tp, split over ep, on every rank]: each part's squares summed over its group
        squares = torch.zeros(3, dtype=torch.float64, device=self.device)
        for g, dim in zip(grads, split_dims, strict=True):
            squares[0 if isinstance(dim, int) else 1 if isinstance(dim, ExpertSplit) else 2] += g.double().pow(2).sum()
        with ddp.collective("the gradient norm's all-reduce"):
            for part, size, group in ((0, self.tp, self.tp_group), (1, self.ep, self.ep_group)):
                if size > 1:
                    sharded = squares[part : part + 1].clone()
                    dist.all_reduce(sharded, group=group)
                    squares[part] = sharded[0]
        return squares.sum().sqrt().float().cpu()

    def gather(self, tensors: dict[str, tuple[Tensor, SplitDim]]) -> dict[str, Tensor] | None:
        with ddp.collective("export's gather over the tensor-parallel group"):
            whole = {key: self._all_gather(t, dim).detach().cpu().clone() for key, (t, dim) in tensors.items()}
        return whole if self.rank == 0 else None

    def whole(self, t: Tensor, split_dim: SplitDim) -> Tensor:
        with ddp.collective("a whole matrix's gather over the tensor-parallel group"):
            return self._all_gather(t, split_dim)

    def _all_gather(self, t: Tensor, split_dim: SplitDim) -> Tensor:
        size, group, dim = self._split(split_dim)
        if dim is None or size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.detach().contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    def shard(self, full: Tensor, split_dim: SplitDim) -> Tensor:
        size, _, dim = self._split(split_dim)
        rank = self.ep_rank if isinstance(split_dim, ExpertSplit) else self.tp_rank
        return full if dim is None else full.chunk(size, dim=dim)[rank]

    def _split(self, split_dim: SplitDim) -> tuple[int, dist.ProcessGroup | None, int | None]:
        """(group size, group, dimension) of a parameter's split."""
        if isinstance(split_dim, ExpertSplit):
            return self.ep, self.ep_group, split_dim.dim
        if isinstance(split_dim, ExpertShared):
            return 1, None, None
        return self.tp, self.tp_group, split_dim
