"""What starts a backend's worker processes: one ``RankSpec`` per device, afresh at every (re)start."""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable

from hosted_tinker.core.config import ServerConfig
from hosted_tinker.rank.plans import backend_options
from hosted_tinker.rank.serve import RankSpec, build_rank
from hosted_tinker.server.workers.backend import Factory


def rank_factories(config: ServerConfig, model_path: str) -> Callable[[], list[Factory]]:
    """Called at each (re)start of the group: one picklable factory per rank, joined by a fresh
    rendezvous (a restarted group must not meet the dead one's port)."""
    options = backend_options(config)  # ValueError at start-up, naming what the plan accepts
    devices = tuple(config.training_devices())

    def group() -> list[Factory]:
        init_method = f"tcp://127.0.0.1:{free_port()}"
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
