"""What starts a backend's worker processes: one ``RankSpec`` per device, afresh at every (re)start."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch.distributed as dist

from hosted_tinker.core.config import ServerConfig
from hosted_tinker.core.tiny_model import weights_sha256
from hosted_tinker.rank.plans import backend_options
from hosted_tinker.rank.serve import RankSpec, build_rank
from hosted_tinker.server.workers.backend import Factory


def rendezvous(host: str) -> tuple[str, dist.TCPStore]:
    """A group's rendezvous: torch.distributed's key-value store, hosted in this process on a port
    the kernel picks as it binds it, and its address (``tcp://host:port``) for the ranks, which
    join it as clients. The caller holds the store for the group's life. (Picking a free port,
    releasing it and letting rank 0 bind it raced with every other process on the machine: a
    replacement group once failed to start with "address already in use".)"""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    return f"tcp://{host}:{store.port}", store


def rank_factories(config: ServerConfig, model_path: str) -> Callable[[], list[Factory]]:
    """Called at each (re)start of the group: one picklable factory per rank, joined by a fresh
    rendezvous (a restarted group must not meet the dead one's)."""
    options = backend_options(config)  # ValueError at start-up, naming what the plan accepts
    devices = tuple(config.rank_devices())
    # How the other nodes find the model (rank.serve.model_here): they lack this data directory.
    tiny = config.model is None
    source: Literal["hub", "folder", "tiny"] = "tiny" if tiny else "folder" if Path(model_path).is_dir() else "hub"
    tiny_sha256 = weights_sha256(model_path) if tiny else None
    # The rendezvous is on node 0; the other nodes reach it where they reach the cluster port.
    host = config.master_addr if config.nnodes > 1 else "127.0.0.1"
    held: list[dist.TCPStore] = []  # the current group's store (the previous group is gone)
    shares_gpu = config.vllm_shares_training_gpu(os.environ.get("CUDA_VISIBLE_DEVICES"))

    def group() -> list[Factory]:
        init_method, store = rendezvous(host)
        held[:] = [store]
        return [
            functools.partial(
                build_rank,
                RankSpec(
                    backend=config.backend,
                    options=options,
                    model_path=model_path,
                    rank=rank,
                    devices=devices,
                    init_method=init_method,
                    dtype=config.dtype,
                    lora_alpha=config.lora_alpha,
                    lora_compute=config.lora_compute,
                    shares_gpu=shares_gpu,
                    max_seq_len=config.max_seq_len,
                    model_source=source,
                    tiny_sha256=tiny_sha256,
                ),
            )
            for rank in range(len(devices))
        ]

    return group
