"""Training backends behind one interface (``base.TrainingBackend``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hosted_tinker.backends.base import TrainingBackend
    from hosted_tinker.config import ServerConfig

BACKENDS = ("peft",)


def make_backend(config: ServerConfig, model_path: str) -> TrainingBackend:
    if config.backend == "peft":
        from hosted_tinker.backends.peft import PeftBackend

        return PeftBackend(
            model_path,
            device=config.device,
            dtype=config.dtype,
            lora_alpha=config.lora_alpha,
            max_seq_len=config.max_seq_len,
            max_tokens_per_microbatch=config.max_tokens_per_microbatch,
        )
    raise ValueError(f"unknown backend {config.backend!r}; available: {', '.join(BACKENDS)}")
