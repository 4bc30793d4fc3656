"""Data parallelism: N ranks over torch.distributed, each a PEFT backend on its own device.

The server runs one worker process per rank (``worker.group``); each holds the base model and
every training model's adapter and optimizer, kept identical on all ranks:

- ``forward_backward``: the batch is split across ranks by token count (``shard_by_tokens``);
  each rank adds its shard's gradients to its own accumulated ones. Whether the request's
  gradients are kept is decided by all ranks together (one tiny all-reduce), so a request that
  fails on one rank leaves no trace on any. Per-datum results are put back in batch order.
- ``create_adapter``: made on every rank or on none, starting from rank 0's initial weights.
- ``optim_step``: the ranks' accumulated gradients are summed (all-reduce, SUM: Tinker's losses
  are sums, so the update is the single-process one whatever the number of ranks), then every
  rank takes the same AdamW step.
- what needs one copy (export, sampling, LoRA sync) is rank 0's.

Every rank enters every collective, also with an empty shard, so a batch smaller than the group
cannot deadlock it. A collective that fails (a peer gone, or silent for ``collective_timeout_s``)
raises ``GroupBroken``: the server then replaces the whole group (``worker.group``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from hosted_tinker.core.errors import GroupBroken
from hosted_tinker.core.types import AdamParams, LoraSpec
from hosted_tinker.rank.peft_backend import PeftBackend


class DdpRank(PeftBackend):
    """One rank: a PEFT backend whose gradients are summed with the other ranks' at each step."""

    NAME = "ddp"

    def __init__(
        self,
        model_path: str,
        *,
        rank: int,
        devices: list[str],
        init_method: str,
        collective_timeout_s: float,
        **peft_options,
    ) -> None:
        device = devices[rank]
        if device == "cpu":  # ranks share the cores: more threads each would only contend
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // len(devices)))
        else:
            torch.cuda.set_device(device)
            # A collective past its timeout then raises in this rank (GroupBroken), rather than
            # NCCL's watchdog aborting the process: that would name the rank that waited.
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        dist.init_process_group(
            "gloo" if device == "cpu" else "nccl",
            init_method=init_method,
            rank=rank,
            world_size=len(devices),
            timeout=timedelta(seconds=collective_timeout_s),
            device_id=None if device == "cpu" else torch.device(device),  # NCCL connects now, not mid-request
        )
        self.rank = rank
        self.world_size = len(devices)
        super().__init__(model_path, device=device, **peft_options)
        self.capabilities = dataclasses.replace(self.capabilities, backend=self.NAME, devices=tuple(devices))

    # With one rank there is no one to agree with or sum with: no collective runs, and a
    # single-GPU ddp costs what peft does.

    def _all_succeeded(self, succeeded: bool) -> bool:
        if self.world_size == 1:
            return succeeded
        with _collective("the ranks' agreement on a call's outcome"):
            flag = torch.tensor([1 if succeeded else 0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            return bool(flag.item())

    def create_adapter(self, model_id: str, lora: LoraSpec) -> None:
        """Created on every rank or on none; then rank 0's initial weights are every rank's, so
        the ranks start out identical whatever else each holds (samplers live on rank 0 only)."""
        failure: Exception | None = None
        try:
            super().create_adapter(model_id, lora)
        except Exception as e:
            failure = e
        error = self._failure_anywhere(failure)
        if error is not None:
            if failure is None:  # made here, not elsewhere
                super().delete_adapter(model_id)
            raise error
        if self.world_size > 1:
            params = self._adapter(model_id).params
            with _collective("create_adapter's broadcast of rank 0's weights"):
                _broadcast_from_rank0(params)

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        if self.world_size > 1:
            weights = self._adapter(model_id).params
            with _collective("optim_step's gradient all-reduce"):
                _sum_gradients(weights)
        return super().optim_step(model_id, params)


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    """Say a failed collective as ``GroupBroken``: after one, no rank knows what the others did.
    The block holds all of it (buffers, the collective, reading its result), so that a rank
    failing on its own device still answers as one that leaves the others waiting."""
    try:
        yield
    except RuntimeError as e:  # gloo's timeouts and closed connections (dist.DistError among them), CUDA errors
        raise GroupBroken(f"{what} failed: {e}") from e


def _broadcast_from_rank0(params: list[nn.Parameter]) -> None:
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    dist.broadcast(flat, src=0)
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _sum_gradients(params: list[nn.Parameter]) -> None:
    """Every rank's gradients summed, on every rank, in one all-reduce. A parameter no rank has
    a gradient for keeps none (AdamW then leaves it alone, as in a single process); one that
    only some ranks have is zero on the others."""
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
    flat = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params]
    buffer = torch.cat([has, *flat])
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    present = buffer[: len(params)].tolist()  # one device-to-host copy, not one per parameter
    offset = len(params)
    for p, has_grad in zip(params, present, strict=True):
        n = p.numel()
        p.grad = buffer[offset : offset + n].view_as(p).to(p.dtype) if has_grad > 0 else None
        offset += n
