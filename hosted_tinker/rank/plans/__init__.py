"""Training backends behind one interface (``base.TrainingBackend``), each with typed options.

- ``peft``: one process on one device (``peft.PeftBackend``);
- ``ddp``: one process per rank over torch.distributed (``ddp.DdpRank``), on ``--train-devices``.

``--backend-option KEY=VALUE`` sets a backend's options; a key it does not have is an error
at start-up, never silently ignored.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from hosted_tinker.core.config import ServerConfig
    from hosted_tinker.core.types import TrainingBackend

Factory = Callable[[], "TrainingBackend"]


class PeftOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    microbatch_tokens: int = Field(16384, ge=1, description="padded tokens per forward/backward micro-batch")


class DdpOptions(PeftOptions):
    collective_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="how long a rank waits for the others (to join, or in a collective) before the group is replaced",
    )


OPTIONS: dict[str, type[PeftOptions]] = {"peft": PeftOptions, "ddp": DdpOptions}
BACKENDS = tuple(OPTIONS)


def backend_options(config: ServerConfig) -> PeftOptions:
    """``config.backend_options`` checked against the backend's options; ``ValueError`` names what
    is wrong and what the backend accepts."""
    model = OPTIONS[config.backend]
    try:
        options = model.model_validate(config.backend_options)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ValueError(
            f"--backend-option for {config.backend}: {problems} (it accepts: {', '.join(model.model_fields)})"
        ) from None
    if isinstance(options, DdpOptions) and options.collective_timeout_s >= config.worker_timeout_s:
        # A hung rank must be caught by the collective that waits for it, which names it.
        raise ValueError(
            f"--backend-option collective_timeout_s={options.collective_timeout_s:g} must be below "
            f"--worker-timeout ({config.worker_timeout_s:g} s)"
        )
    return options


def rank_factories(config: ServerConfig, model_path: str) -> Callable[[], list[Factory]]:
    """What starts the backend's worker processes: called at each (re)start, it returns one
    picklable factory per rank (a data-parallel group gets a fresh rendezvous each time)."""
    options = backend_options(config)
    devices = config.training_devices()
    if config.backend == "peft":
        factory = functools.partial(_peft, config, model_path, devices[0], options)
        return lambda: [factory]

    def group() -> list[Factory]:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        return [
            functools.partial(_ddp_rank, config, model_path, options, rank, devices, init_method)
            for rank in range(len(devices))
        ]

    return group


def _peft(config: ServerConfig, model_path: str, device: str, options: PeftOptions) -> TrainingBackend:
    from hosted_tinker.rank.peft_backend import PeftBackend

    return PeftBackend(model_path, device=device, **_peft_kwargs(config, options))


def _ddp_rank(
    config: ServerConfig, model_path: str, options: DdpOptions, rank: int, devices: list[str], init_method: str
) -> TrainingBackend:
    from hosted_tinker.rank.plans.ddp import DdpRank

    return DdpRank(
        model_path,
        rank=rank,
        devices=devices,
        init_method=init_method,
        collective_timeout_s=options.collective_timeout_s,
        **_peft_kwargs(config, options),
    )


def _peft_kwargs(config: ServerConfig, options: PeftOptions) -> dict:
    return {
        "dtype": config.dtype,
        "lora_alpha": config.lora_alpha,
        "max_seq_len": config.max_seq_len,
        "max_tokens_per_microbatch": options.microbatch_tokens,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
