"""Everything a running server holds, built once from its config."""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from hosted_tinker.backends import make_backend
from hosted_tinker.backends.base import TrainingBackend
from hosted_tinker.checkpoints import CheckpointFiles
from hosted_tinker.config import ServerConfig
from hosted_tinker.scheduler import Scheduler
from hosted_tinker.serving.checkpoints import CheckpointService
from hosted_tinker.serving.openai import OpenAIService
from hosted_tinker.serving.sampling import SamplingService
from hosted_tinker.serving.sessions import SessionService
from hosted_tinker.serving.training import TrainingService
from hosted_tinker.store import Store

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    config: ServerConfig
    store: Store
    scheduler: Scheduler
    backend: TrainingBackend
    sessions: SessionService
    training: TrainingService
    checkpoints: CheckpointService
    sampling: SamplingService
    openai: OpenAIService


def build_state(config: ServerConfig) -> ServerState:
    config.data_dir.mkdir(parents=True, exist_ok=True)
    model_path = config.model_path()
    store = Store(config.data_dir / "hosted_tinker.sqlite")
    failed, lost = store.recover_after_restart()
    if failed or lost:
        log.warning("restart: failed %d in-flight futures, %d models need recreating", failed, lost)
    backend = make_backend(config, model_path)
    scheduler = Scheduler(store)
    training = TrainingService(
        backend, scheduler, store, config.served_names(), tokenizer_id=config.tokenizer_id or model_path
    )
    files = CheckpointFiles(config.data_dir / "checkpoints")
    ephemeral = CheckpointFiles(config.data_dir / "ephemeral")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    sampling = SamplingService(
        backend,
        scheduler,
        store,
        files,
        ephemeral,
        tokenizer,
        _eos_ids(model_path, tokenizer),
        batch_window_s=config.sample_batch_window_s,
    )
    checkpoints = CheckpointService(training, files, ephemeral, secret=_server_secret(config.data_dir))
    return ServerState(
        config=config,
        store=store,
        scheduler=scheduler,
        backend=backend,
        sessions=SessionService(store, training, on_finish=checkpoints.finish_session),
        training=training,
        checkpoints=checkpoints,
        sampling=sampling,
        openai=OpenAIService(sampling, store, config.served_names()),
    )


def _eos_ids(model_path: str, tokenizer) -> set[int]:
    """Tokens that end a sequence when a request names no stop: the tokenizer's and the model's."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    return ids


def _server_secret(data_dir: Path) -> bytes:
    """A random key kept with the data, for signing download links; survives restarts."""
    path = data_dir / "server.key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    return path.read_bytes()
