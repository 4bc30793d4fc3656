"""What starts a backend's worker processes: one ``RankSpec`` per device, afresh at every (re)start."""

from __future__ import annotations

import functools
from collections.abc import Callable

from hosted_tinker.core.config import ServerConfig
from hosted_tinker.inference.vllm_process import free_port
from hosted_tinker.rank.plans import backend_options
from hosted_tinker.rank.serve import RankSpec, build_rank
from hosted_tinker.server.workers.backend import Factory


def rank_factories(config: ServerConfig, model_path: str) -> Callable[[], list[Factory]]:
    """Called at each (re)start of the group: one picklable factory per rank, joined by a fresh
    rendezvous (a restarted group must not meet the dead one's port)."""
    options = backend_options(config)  # ValueError at start-up, naming what the plan accepts
    devices = tuple(config.rank_devices())
    # torch.distributed's rendezvous is hosted by rank 0, here on node 0; the other nodes reach it
    # where they reach the cluster port.
    host = config.master_addr if config.nnodes > 1 else "127.0.0.1"

    def group() -> list[Factory]:
        init_method = f"tcp://{host}:{free_port(host)}"
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
                    max_seq_len=config.max_seq_len,
                ),
            )
            for rank in range(len(devices))
        ]

    return group
