"""Data parallelism: N ranks over torch.distributed, each a full replica on its own device.

Every rank holds the base model and every training model's adapter and optimizer, kept
identical on all ranks. The server gives each rank a shard of a ``forward_backward`` batch
(``core.sharding``); the trainer adds the shard's gradients to the rank's own. The plan adds
three collectives to the single-process step:

- agreement on a call's outcome (one tiny all-reduce), so a request that fails on one rank
  leaves no trace on any;
- at ``optim_step``, the ranks' gradients summed (all-reduce, SUM: Tinker's losses are sums, so
  the update is the single-process one whatever the number of ranks);
- a new adapter's initial weights broadcast from rank 0.

With one rank no collective runs: it is exactly the ``single`` plan. Every rank enters every
collective, also with an empty shard, so a batch smaller than the group cannot deadlock it. A
collective that fails (a peer gone, or silent for ``collective_timeout_s``) raises
``GroupBroken``: the server then replaces the whole group (``server.workers.group``).
"""

from __future__ import annotations

import contextlib
import os
import urllib.parse
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hosted_tinker.core.errors import GroupBroken
from hosted_tinker.rank.model import HfLoraModel, SplitDim
from hosted_tinker.rank.plans import single
from hosted_tinker.rank.plans.options import DdpOptions as Options
from hosted_tinker.rank.plans.single import local_norm

DEVICES = "one per rank: --train-devices cpu:N | cuda:0,1,..."  # what `hosted-tinker backends` says of where it trains
MODELS = single.MODELS  # each rank is the peft backend's model
# tests/e2e/test_plans.py: two CPU ranks as they come, and recomputing every layer over small micro-batches.
CHECKED_LAYOUTS = [
    (None, {}),
    (None, {"recompute_above_tokens": "0", "microbatch_tokens": "48"}),
    (None, {"activation_memory_gib": "0.001", "microbatch_tokens": "48"}),  # some micro-batches store, some not
]


class Plan:
    def __init__(self, rank: int, devices: list[str], init_method: str, options: Options) -> None:
        self.rank = rank
        self.world_size = self.replicas = len(devices)
        self.device = devices[rank]
        self.replica_group: dist.ProcessGroup | None = None  # the ranks holding the same tensors: all
        if self.device == "cpu":  # ranks share the cores: more threads each would only contend
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // len(devices)))
        else:
            torch.cuda.set_device(self.device)
            # A collective past its timeout then raises in this rank (GroupBroken), rather than
            # NCCL's watchdog aborting the process: that would name the rank that waited.
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        timeout = timedelta(seconds=options.collective_timeout_s)
        # The server hosts the group's store (``server.workers.launch.rendezvous``): every rank,
        # rank 0 included, joins it as a client.
        address = urllib.parse.urlsplit(init_method)
        if address.hostname is None or address.port is None:
            raise ValueError(f"init_method {init_method!r} names no host and port")
        store = dist.TCPStore(address.hostname, address.port, len(devices), is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo" if self.device == "cpu" else "nccl",
            store=store,
            rank=rank,
            world_size=len(devices),
            timeout=timeout,
            device_id=None if self.device == "cpu" else torch.device(self.device),  # NCCL connects now
        )

    def build_model(self, model_path: str, *, dtype: str, lora_alpha: float, lora_compute: str) -> HfLoraModel:
        return HfLoraModel(
            model_path, device=self.device, dtype=dtype, lora_alpha=lora_alpha, lora_compute=lora_compute
        )

    def all_succeeded(self, succeeded: bool) -> bool:
        if self.world_size == 1:
            return succeeded
        with collective("the ranks' agreement on a call's outcome"):
            flag = torch.tensor([1 if succeeded else 0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            return bool(flag.item())

    def passes(self, count: int) -> int:
        return count  # replicas run their own shards' passes

    def least(self, value: float) -> float:
        return value  # replicas run their own shards' passes: theirs need not match

    def shard_failed(self, failed: bool) -> bool:
        return failed  # a shard runs on one rank

    def broadcast_initial(self, params: list[nn.Parameter], split_dims: list[SplitDim]) -> None:
        self.broadcast(params, self.replica_group)

    def broadcast(self, params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
        """``params`` made the same on every rank of ``group`` (its first rank's), in one broadcast."""
        if not params or dist.get_world_size(group) == 1:
            return
        with collective("create_adapter's broadcast of rank 0's weights"):
            flat = torch.cat([p.detach().reshape(-1).float() for p in params])
            dist.broadcast(flat, group=group, group_src=0)
            offset = 0
            with torch.no_grad():
                for p in params:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()

    def reduce_gradients(self, params: list[nn.Parameter], split_dims: list[SplitDim]) -> None:
        self.sum_gradients(params, self.replica_group)

    def sum_gradients(self, params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
        """Every rank's gradients of ``params`` summed over ``group``, on each of its ranks, in one
        all-reduce. A parameter no rank has a gradient for keeps none (AdamW then leaves it alone,
        as in a single process); one that only some ranks have is zero on the others."""
        if not params or dist.get_world_size(group) == 1:
            return
        with collective("optim_step's gradient all-reduce"):
            has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
            flat = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params]
            buffer = torch.cat([has, *flat])
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
            present = buffer[: len(params)].tolist()  # one device-to-host copy, not one per parameter
        offset = len(params)
        for p, has_grad in zip(params, present, strict=True):
            n = p.numel()
            p.grad = buffer[offset : offset + n].view_as(p).to(p.dtype) if has_grad > 0 else None
            offset += n

    def replicas_of(self, split_dim: SplitDim) -> int:
        return self.replicas

    def grad_norm(self, grads: list[Tensor], split_dims: list[SplitDim]) -> Tensor:
        return local_norm(grads)  # after reduce_gradients every rank holds the whole gradient

    def gather(self, tensors: dict[str, tuple[Tensor, SplitDim]]) -> dict[str, Tensor] | None:
        if self.rank != 0:  # replicas: rank 0 already holds every tensor whole
            return None
        return {key: t.detach().cpu().clone() for key, (t, _) in tensors.items()}

    def shard(self, full: Tensor, split_dim: SplitDim) -> Tensor:
        return full

    def whole(self, t: Tensor, split_dim: SplitDim) -> Tensor:
        return t


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Say a failed collective as ``GroupBroken``: after one, no rank knows what the others did.
    The block holds all of it (buffers, the collective, reading its result), so that a rank
    failing on its own device still answers as one that leaves the others waiting."""
    try:
        yield
    except RuntimeError as e:  # gloo's timeouts and closed connections (dist.DistError among them), CUDA errors
        raise GroupBroken(f"{what} failed: {e}") from e
