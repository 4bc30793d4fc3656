"""Everything a running server holds, built once from its config."""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from fastapi import Request

from hosted_tinker.core.checkpoints import MANIFEST, CheckpointFiles
from hosted_tinker.core.config import ServerConfig, read_cluster_key, visible_gpu
from hosted_tinker.core.pretrained import auto_tokenizer
from hosted_tinker.inference.embedded import EmbeddedEngine
from hosted_tinker.inference.engine import WeightsRef
from hosted_tinker.inference.lora_sync import default_root, write_zero_adapter
from hosted_tinker.inference.vllm_engine import VllmEngine
from hosted_tinker.inference.vllm_layout import VllmLayout, read_hf_config
from hosted_tinker.inference.vllm_process import ExternalVllm, VllmLaunch, VllmSupervisor, free_port
from hosted_tinker.inference.vllm_setup import check_vllm_python, default_vllm_python
from hosted_tinker.server.api.inflight import BodyBytes
from hosted_tinker.server.console.signin import ConsoleSignIn
from hosted_tinker.server.keys import KeyRing, env_keys, read_keys_file
from hosted_tinker.server.metrics import ServerMetrics
from hosted_tinker.server.mirror import NO_MIRROR, CheckpointMirror
from hosted_tinker.server.persistence.schema import DATABASE, DatabaseDamaged
from hosted_tinker.server.persistence.schema import check as check_database
from hosted_tinker.server.persistence.sequences import SequenceRecords, model_identity
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.quotas import Limits, Quotas
from hosted_tinker.server.scheduler import QueueLimits, Scheduler
from hosted_tinker.server.serving.anthropic import AnthropicService
from hosted_tinker.server.serving.audit import AuditLog
from hosted_tinker.server.serving.checkpoints import CheckpointService
from hosted_tinker.server.serving.copies import CopyService
from hosted_tinker.server.serving.custom_losses import CustomLossService
from hosted_tinker.server.serving.downloads import DownloadLinks
from hosted_tinker.server.serving.futures import FuturesService
from hosted_tinker.server.serving.images import ImageLayout, ImageTokens
from hosted_tinker.server.serving.joint_passes import JointPasses
from hosted_tinker.server.serving.openai import OpenAIService
from hosted_tinker.server.serving.openai_proxy import OpenAIProxy
from hosted_tinker.server.serving.recovery import ModelRecovery
from hosted_tinker.server.serving.residency import Residency, park_after_kill
from hosted_tinker.server.serving.run_metrics import RunMetrics
from hosted_tinker.server.serving.runs import RunViews
from hosted_tinker.server.serving.sample_budget import SampleBudget
from hosted_tinker.server.serving.sampling import SamplingService
from hosted_tinker.server.serving.sessions import SessionService
from hosted_tinker.server.serving.subscribers import checkpoint_events, training_events
from hosted_tinker.server.serving.tenancy import Tenancy
from hosted_tinker.server.serving.training import TrainingService
from hosted_tinker.server.serving.uploads import UploadService
from hosted_tinker.server.serving.usage import UsageLedger
from hosted_tinker.server.workers.backend import ProcessBackend
from hosted_tinker.server.workers.cluster import Cluster
from hosted_tinker.server.workers.launch import rank_factories

log = logging.getLogger(__name__)

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass
class ServerState:
    config: ServerConfig
    store: Store
    sequences: SequenceRecords
    keys: KeyRing
    tenancy: Tenancy
    scheduler: Scheduler
    backend: ProcessBackend
    sessions: SessionService
    training: TrainingService
    checkpoints: CheckpointService
    runs: RunViews
    copies: CopyService
    uploads: UploadService
    custom_losses: CustomLossService
    futures: FuturesService
    sampling: SamplingService
    openai: OpenAIService
    anthropic: AnthropicService
    quotas: Quotas
    body_bytes: BodyBytes
    run_metrics: RunMetrics
    usage: UsageLedger
    audit: AuditLog
    console: ConsoleSignIn
    vllm: VllmEngine | None = None
    openai_proxy: OpenAIProxy | None = None

    def is_operator(self, tenant: str | None) -> bool:
        """Whether ``tenant`` sees the whole server (the console's server page, every model's
        series in /metrics): a key named by ``--console-operator``, or anyone on a server
        without keys."""
        return not self.keys.required or (tenant is not None and tenant in self.config.console_operators)


def server_state(request: Request) -> ServerState:
    """The state of the server a request reached (for the routers)."""
    return request.app.state.server


def build_state(config: ServerConfig) -> ServerState:
    # The model runs in the worker process; this one only moves small tensors. A pool of
    # intra-op threads here would spin after each of them, on the cores the worker computes on.
    torch.set_num_threads(1)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        check_database(config.data_dir / DATABASE)
    except DatabaseDamaged as e:
        raise SystemExit(str(e)) from None
    store = Store.in_data_dir(config.data_dir)
    run_metrics = RunMetrics(store.path)  # each run's steps, for GET /training_runs/{id}/metrics
    try:
        static_keys = env_keys() + (read_keys_file(config.api_keys_file) if config.api_keys_file else [])
    except (ValueError, OSError) as e:
        raise SystemExit(f"API keys: {e}") from None
    keys = KeyRing(store, static_keys, allow_any=config.dev_any_key)
    model_path = config.model_path()  # builds the tiny model on first use: after the refusals above
    sequences = SequenceRecords(store.path, model=model_identity(model_path))
    files = CheckpointFiles(config.data_dir / "checkpoints")
    ephemeral = CheckpointFiles(config.data_dir / "ephemeral")
    parked = CheckpointFiles(config.data_dir / "parked")  # models saved whole off the workers (Residency)
    for staging in (files, ephemeral, parked):
        if removed := staging.clear_staging():
            log.info("removed %d unfinished writes left in %s by an earlier run", removed, staging.root)
    if adopted := park_after_kill(store, files, parked):  # models loaded when the server was killed
        log.warning("restart after a kill: %d models come back from their last saved state", len(adopted))
    failed, lost = store.recover_after_restart()
    if failed or lost:
        log.warning("restart: failed %d in-flight futures, %d models need recreating", failed, lost)
    # A refusal after the ranks have started (a model --inference vllm cannot serve, an unreadable
    # mirror) must stop them: the exit would otherwise wait on worker processes that wait for calls.
    with ExitStack() as on_failure:
        backend = ProcessBackend(rank_factories(config, model_path), config.worker_timeout_s, _cluster(config))
        on_failure.callback(backend.close)
        limits = QueueLimits(config.max_pending, config.max_pending_per_model, config.max_pending_bytes)
        quotas = Quotas(
            store,
            Limits(**config.key_limits),
            config.max_lora_rank,
            limits,
            inflight_body_bytes=config.max_inflight_body_bytes,
            lora_params_per_rank=backend.capabilities.lora_params_per_rank,
        )
        scheduler = Scheduler(store, limits, ServerMetrics(), keys=quotas)
        tokenizer = auto_tokenizer(model_path)
        caps = backend.capabilities
        pids = backend.status()["pids"]
        log.info("%s backend (pids %s): %s on %s", caps.backend, pids, caps.arch, ", ".join(caps.devices))
        vllm = _build_vllm(config, model_path, backend) if config.uses_vllm else None
        images = ImageLayout(caps, ImageTokens(model_path, caps.image_token_id) if caps.images else None)
        custom_losses = CustomLossService(store, scheduler, quotas)
        residency = Residency(backend, store, scheduler, parked, max_resident=config.max_resident_models)
        usage = UsageLedger(store)
        audit = AuditLog(store)
        training = TrainingService(
            backend,
            scheduler,
            store,
            config.served_names(),
            tokenizer_id=config.tokenizer_id or model_path,
            sequences=sequences,
            custom_losses=custom_losses,
            residency=residency,
            joint=JointPasses(backend.trainer, scheduler, residency.is_resident, config.joint_pass_tokens),
            quotas=quotas,
            events=training_events(backend, scheduler.metrics, usage, run_metrics, vllm),
            max_lora_rank=config.max_lora_rank if vllm is not None else None,
            images=images,
        )
        sampling = SamplingService(
            backend,
            scheduler,
            store,
            files,
            ephemeral,
            tokenizer,
            _eos_ids(model_path, tokenizer),
            EmbeddedEngine(
                backend.sampler,
                scheduler.run_on_worker,
                config.sample_batch_window_s,
                config.sample_slice_s,
                family=caps.family,
            ),
            sequences,
            vllm,
            served_names=config.served_names(),
            usage=usage,
            images=images,
            budget=SampleBudget(
                config.max_sample_tokens, lambda key: None if (lim := quotas.of(key)) is None else lim.sample_tokens
            ),
            record_limit=lambda key: None if (lim := quotas.of(key)) is None else lim.record_bytes,
        )
        mirror = CheckpointMirror(config.checkpoint_mirror, files, store) if config.checkpoint_mirror else None
        if mirror is not None:
            restored, queued = mirror.sync()
            log.info("checkpoint mirror %s: %d checkpoints restored, %d to copy up", mirror.url, restored, queued)
        tenancy = Tenancy(store, audit)
        events = checkpoint_events(scheduler.metrics, usage, audit, mirror, vllm)
        checkpoints = CheckpointService(
            training,
            files,
            ephemeral,
            links=DownloadLinks(
                files,
                _server_secret(config.data_dir),
                version=store.checkpoint_created_at,
                # A link is checked again at each fetch, as a request of the key it was made for.
                may_read=lambda tenant, path: keys.still_valid(tenant) and tenancy.can_read(tenant, path),
                may_trace=lambda tenant, session_id: keys.still_valid(tenant) and tenancy.owns(tenant, session_id),
            ),
            tenancy=tenancy,
            events=events,
            mirror=mirror if mirror is not None else NO_MIRROR,
        )
        # The one link made after construction: the backend restores models through the training
        # service, which itself calls the backend.
        backend.recovery = ModelRecovery(training, files)
        if orphans := training.residency.clear_orphans():
            log.info("removed %d saved states of models that were not parked", orphans)
        for model_id, next_seq in store.parked_models():  # saved whole when the server last stopped
            scheduler.open_model(model_id, first_seq=next_seq)
        openai = OpenAIService(sampling, store, tenancy, config.served_names(), live_runs=vllm is not None)
        state = ServerState(
            config=config,
            store=store,
            sequences=sequences,
            keys=keys,
            tenancy=tenancy,
            scheduler=scheduler,
            backend=backend,
            sessions=SessionService(
                store, training, quotas, on_finish=_on_finish(checkpoints, custom_losses), audit=audit
            ),
            training=training,
            checkpoints=checkpoints,
            runs=RunViews(store),
            copies=CopyService(store, files, tenancy, quotas, events),
            uploads=UploadService(
                training, files, _server_secret(config.data_dir), quotas, may_upload=keys.still_valid, events=events
            ),
            custom_losses=custom_losses,
            futures=FuturesService(store, scheduler, config.poll_timeout_s),
            sampling=sampling,
            openai=openai,
            anthropic=AnthropicService(openai),
            quotas=quotas,
            body_bytes=BodyBytes(config.max_inflight_body_bytes, quotas.body_bytes),
            run_metrics=run_metrics,
            usage=usage,
            audit=audit,
            console=ConsoleSignIn(_server_secret(config.data_dir)),
            vllm=vllm,
            openai_proxy=OpenAIProxy(openai, vllm) if vllm is not None else None,
        )
        scheduler.metrics.watch(lambda: _metrics_state(state))
        on_failure.pop_all()  # the server owns the ranks now
        return state


def _on_finish(checkpoints: CheckpointService, custom_losses: CustomLossService) -> Callable[[str], None]:
    """What a finished session leaves: its sampler snapshots and its custom losses go."""

    def finished(session_id: str) -> None:
        checkpoints.snapshots.finish_session(session_id)
        custom_losses.finish_session(session_id)

    return finished


def _metrics_state(state: ServerState) -> dict:
    """What /metrics reads from the server's parts at each scrape (``metrics.StateCollector``)."""
    vllm = state.vllm
    return {
        "queue": state.scheduler.pending_per_model(),
        "in_flight": state.scheduler.in_flight,
        "resident_models": state.training.residency.status()["resident"],
        "parked_models": state.store.count_active()["parked_models"],
        "worker_restarts": state.backend.restarts,
        "ranks": state.backend.status()["ranks"],
        "joint_passes": {"passes": state.training.joint.passes, "joined": state.training.joint.joined},
        "vllm_restarts": vllm.status().get("restarts", 0) if vllm is not None else None,
        "lora_sync": {"count": vllm.live.synced, "seconds_total": vllm.live.latency_total} if vllm else None,
    }


def _cluster(config: ServerConfig) -> Cluster | None:
    """Node 0's cluster port, where the other nodes' agents connect (``--nnodes`` > 1)."""
    if config.nnodes == 1:
        return None
    try:
        key = read_cluster_key(config.cluster_key_file)
        cluster = Cluster(config.nnodes, len(config.training_devices()), (config.master_addr, config.master_port), key)
    except (ValueError, OSError) as e:
        raise SystemExit(f"--nnodes {config.nnodes}: {e}") from None
    log.info(
        "node 0 of %d: the other nodes connect to %s:%d (`hosted-tinker node --node-rank K ...`)",
        config.nnodes,
        *cluster.address,
    )
    return cluster


def _build_vllm(config: ServerConfig, model_path: str, backend: ProcessBackend) -> VllmEngine:
    """The vLLM engine: a supervised child process, or a server at ``--inference-url``."""
    on_gpu = config.vllm_gpus is not None or config.training_devices()[0].startswith("cuda")
    try:  # which classes vLLM builds, from the checkpoint's own config (a hub id's too)
        layout = VllmLayout.of(read_hf_config(model_path), backend.capabilities, config.vllm_routing == "record")
    except (OSError, ValueError) as e:
        raise SystemExit(f"--inference vllm: cannot read {model_path}'s config.json ({e})") from None
    if config.vllm_routing == "record" and not layout.routing.layers:
        caps = backend.capabilities
        why = "has no routed experts" if not caps.routed_experts else "has routers this server does not replay"
        log.warning("--vllm-routing record: %s %s; vLLM is asked for no routing", caps.arch, why)
    if (refused := layout.refusal(on_gpu)) is not None:
        raise SystemExit(
            f"--inference vllm: {refused}; serve it with the embedded engine "
            "(leave out --inference vllm / --inference-url)"
        )
    try:
        max_lora_rank = layout.max_lora_rank(config.max_lora_rank)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if config.inference_url is not None:
        host: ExternalVllm | VllmSupervisor = ExternalVllm(config.inference_url)
        if layout.launch_args() or max_lora_rank != config.max_lora_rank:
            needs = [*layout.launch_args(), "--max-lora-rank", str(max_lora_rank)]
            log.warning("--inference-url: %s's adapters need vLLM started with %s", layout.arch, " ".join(needs))
    else:
        python = config.vllm_python or default_vllm_python()
        if python is not None:
            python = os.path.abspath(python)  # not resolve(): a venv's python is a symlink out of it
        if python is None:
            raise SystemExit(
                "--inference vllm: this interpreter cannot import vllm. Create its environment with "
                "`hosted-tinker setup-vllm DIR` and pass --vllm-python DIR/bin/python."
            )
        try:
            version = check_vllm_python(python)
        except (RuntimeError, OSError) as e:
            raise SystemExit(f"--vllm-python {python}: {e}") from None
        log.info("vLLM %s from %s", version, python)
        inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            sharing_gpu = config.vllm_shares_training_gpu(inherited)
            gpus = config.vllm_gpus
            if gpus is None and sharing_gpu:  # default: rank 0's GPU, shared
                gpus = visible_gpu(config.training_devices()[0], inherited)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        launch = VllmLaunch(
            python=python,
            model=model_path,
            served_names=config.served_names(),
            port=config.vllm_port or free_port(),
            dtype=config.dtype,
            max_lora_rank=max_lora_rank,
            max_loras=config.vllm_max_loras,
            max_model_len=backend.capabilities.max_seq_len,
            gpus=gpus,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization or (0.45 if sharing_gpu else None),
            extra_args=[*layout.launch_args(), *config.vllm_args],
            log_path=config.data_dir / "logs" / "vllm.log",
        )
        host = VllmSupervisor(launch)

    def files_version(weights: WeightsRef) -> str:
        files, path = weights.saved()
        return str((files.directory(path) / MANIFEST).stat().st_mtime_ns)

    def verify(weights: WeightsRef) -> None:  # SHA-256 of every file, before vLLM reads them
        files, path = weights.saved()
        files.read(path, only=ADAPTER_FILES)

    root = default_root(config.data_dir)
    zero = None if on_gpu else write_zero_adapter(root, *backend.trainer.zero_adapter(), layout)  # see VllmEngine
    return VllmEngine(host, files_version, verify, root, zero, backend.capabilities.family, layout)


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


SECRET_BYTES = 32


def _server_secret(data_dir: Path) -> bytes:
    """A random key kept with the data, for signing download links and console cookies; it
    survives restarts. Written whole or not at all (a file cut short would sign with a guessable
    key), and refused if it is not what was written."""
    path = data_dir / "server.key"
    if not path.exists():
        staged = path.with_name(f".server.key.{os.getpid()}")
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(SECRET_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(staged, path)  # never replaces a key another process made meanwhile
        except FileExistsError:
            pass
        finally:
            staged.unlink()
    secret = path.read_bytes()
    if len(secret) != SECRET_BYTES:
        raise SystemExit(f"{path} holds {len(secret)} bytes, not {SECRET_BYTES}: delete it to make a new one")
    return secret
