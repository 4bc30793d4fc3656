"""Saving and loading training state, sampler/external adapter exports (a sampler's unnamed
snapshot: ``serving.snapshots``), and what is done to a checkpoint once it is saved.

Saves and legacy loads are ordinary ordered requests of their model (they take a ``seq_id``);
their jobs run on the backend worker, so a save sees exactly the weights that every earlier
request of the model produced. File I/O happens in those jobs, never on the event loop.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import torch

from hosted_tinker.core.adapter_layout import WEIGHTS
from hosted_tinker.core.calls import on_rank_0
from hosted_tinker.core.checkpoints import (
    CheckpointError,
    CheckpointFiles,
    TinkerPath,
    adapter_files,
    adapter_weights,
    state_from_files,
    state_to_files,
    training_meta,
    validate_name,
)
from hosted_tinker.core.checkpoints import describe as describe_checkpoint
from hosted_tinker.core.checkpoints import description as describe_lora
from hosted_tinker.core.encryption import encrypt_files, parse_recipients
from hosted_tinker.core.errors import ApiError, bad_request, not_found
from hosted_tinker.core.types import AdapterState, LoraSpec
from hosted_tinker.server.mirror import NO_MIRROR, CheckpointMirror, NoMirror
from hosted_tinker.server.persistence.records import CheckpointRecord, ModelRecord
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.protocol.responses import iso_time
from hosted_tinker.server.quotas import Reservation, store_checkpoint
from hosted_tinker.server.scheduler import Job, Scheduler
from hosted_tinker.server.serving import optimizers
from hosted_tinker.server.serving.downloads import DownloadLinks
from hosted_tinker.server.serving.events import Changed, CheckpointEvents, Deleted, Made
from hosted_tinker.server.serving.snapshots import SamplerSnapshots
from hosted_tinker.server.serving.tenancy import Tenancy
from hosted_tinker.server.serving.training import TrainingService, json_result, model_optimizer
from hosted_tinker.server.workers.backend import ProcessBackend

MIN_TTL_S = 3600
MAX_TTL_S = 10 * 365 * 86400


def _iso(t: float) -> str:
    return iso_time(t).isoformat()


def check_ttl(ttl_seconds: int | None) -> None:
    if ttl_seconds is not None and not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise bad_request(f"ttl_seconds must be between {MIN_TTL_S} and {MAX_TTL_S} (or null), got {ttl_seconds}")


class CheckpointService:
    def __init__(
        self,
        training: TrainingService,
        files: CheckpointFiles,
        ephemeral: CheckpointFiles,
        links: DownloadLinks,
        *,
        tenancy: Tenancy,
        events: CheckpointEvents | None = None,
        mirror: CheckpointMirror | NoMirror = NO_MIRROR,
    ) -> None:
        self.events = events if events is not None else CheckpointEvents()  # what follows (``serving.events``)
        self.training = training
        self.backend: ProcessBackend = training.backend
        self.scheduler: Scheduler = training.scheduler
        self.store: Store = training.store
        self.files = files
        # behind save_weights_and_get_sampling_client: saved as the model's ordered requests, as these
        self.snapshots = SamplerSnapshots(training, ephemeral, self.events, self._export)
        self.links = links  # signed download links of external weights
        self.tenancy = tenancy  # who may read the checkpoint a load names
        # --checkpoint-mirror: a deletion's row goes with the mirror's tombstone (``_delete``); the
        # rest of what it is told comes by ``events``.
        self.mirror = mirror

    # ---- saving -----------------------------------------------------------------------------

    def _save(
        self,
        kind: str,
        model_id: str,
        seq_id: int,
        name: str,
        owner: str,
        *,
        overwrite: bool,
        ttl_seconds: int | None,
        user_metadata: dict[str, str] | None,
        extra: dict | None = None,
        encrypt_to: list[str] | None = None,
        refusal: ApiError | None = None,
    ) -> str:
        """Queue a save of ``owner``'s model. Once the request is known to be new and to fit the
        queue, its ``prepare`` first reserves the likely size of the checkpoint from ``owner``'s
        checkpoint bytes (``Quotas.reserve_checkpoint``), settled when it is written, released
        if it never is; a refusal there, or ``refusal`` (a request its caller found wrong,
        answered after the quota's as it always was), uses up the seq_id as every refusal in
        ``prepare`` does (``TrainingService.submit_ordered``)."""
        request_kind = {
            "weights": "save_weights",
            "sampler_weights": "save_weights_for_sampler",
            "external_weights": "save_weights_external",
        }[kind]

        def prepare(model: ModelRecord, held: Reservation) -> Job:
            if refusal is not None:
                raise refusal
            check_ttl(ttl_seconds)
            try:
                path = TinkerPath(model_id, kind, validate_name(name))
                recipients = parse_recipients(encrypt_to) if encrypt_to is not None else None
            except (CheckpointError, ValueError) as e:
                raise bad_request(str(e)) from None
            if not overwrite and self.store.get_checkpoint(model_id, kind, name) is not None:
                raise bad_request(f"{path} already exists; save under another name or pass overwrite=True")

            def job() -> tuple[bytes, str]:
                try:
                    files = self._export(kind, model)
                    if recipients is not None:
                        files = encrypt_files(files, recipients)
                except BaseException:
                    held.release()
                    raise
                size = sum(len(data) for data in files.values())
                replaced = self.store.get_checkpoint(model_id, kind, name)

                def record() -> None:
                    self.store.put_checkpoint(
                        model_id,
                        kind,
                        name,
                        size_bytes=size,
                        ttl_seconds=ttl_seconds,
                        user_metadata=user_metadata or {},
                    )

                # over the key's checkpoint bytes: refused before it is written
                write = partial(self.files.write, path, files, overwrite=overwrite)
                undo = None if overwrite else partial(self.files.delete, path)  # (an overwritten one is gone)
                store_checkpoint(held, size, write, record, replaces=replaced.size_bytes if replaced else 0, undo=undo)
                self.events.made(Made(path, owner, size, self.files))  # its model's owner: the route checked
                result = {"path": str(path), "type": request_kind, **(extra or {})}
                if kind == "external_weights":
                    result["size_bytes"] = size
                return json_result(result)

            return job

        held: Reservation | None = None
        queued = False

        def prepare_holding(model: ModelRecord) -> Job:
            nonlocal held, queued
            reserved = self.training.quotas.reserve_checkpoint(owner, user_metadata, self.likely_size(model_id, kind))
            if isinstance(reserved, ApiError):
                raise reserved
            held = reserved
            return prepare(model, held)

        try:
            request_id = self.training.submit_ordered(request_kind, model_id, seq_id, prepare_holding)
            queued = True  # from here the job settles or releases what is held
        finally:
            if held is not None and not queued:  # refused after its reservation
                held.release()
        if held is not None:  # a job dropped before it runs (its model unloaded) lets go too
            self.scheduler.when_done(request_id, held.release)
        return request_id

    def likely_size(self, model_id: str, kind: str) -> int:
        """What a save of ``model_id``'s ``kind`` will likely take: its newest such checkpoint's
        bytes (0 before the first), reserved when a save is submitted."""
        return next((c.size_bytes for c in self.store.list_checkpoints(model_id) if c.kind == kind), 0)

    def _export(self, kind: str, model: ModelRecord) -> dict[str, bytes]:
        config = self.backend.trainer.peft_config(model.model_id)
        config["base_model_name_or_path"] = model.base_model
        # Only training state needs the optimizer moments (twice the adapter's size).
        state = on_rank_0(self.backend.trainer.export_state(model.model_id, with_optimizer=kind == "weights"))
        if kind == "weights":
            return state_to_files(state, config, model.base_model, self.backend.capabilities.family)
        return adapter_files(config, state.weights, self.backend.capabilities.family)

    def save_weights(self, req: wire.SaveWeightsRequest, owner: str) -> str:
        """``owner``: the key that owns ``req.model_id`` (the route checked), whose bytes it takes."""
        name = req.path if req.path is not None else f"seq-{req.seq_id}"
        return self._save(
            "weights",
            req.model_id,
            req.seq_id,
            name,
            owner,
            overwrite=req.overwrite,
            ttl_seconds=req.ttl_seconds,
            user_metadata=req.user_metadata,
        )

    def save_weights_for_sampler(self, req: wire.SaveWeightsForSamplerRequest, owner: str) -> str:
        """A named save is stored (``owner``'s bytes); an unnamed one is a sampler's snapshot."""
        refusal = None
        if req.kind not in ("snapshot", "inflight"):
            refusal = bad_request(f"kind must be 'snapshot' or 'inflight', got {req.kind!r}")
        elif req.kind == "inflight" and req.path is not None:
            refusal = bad_request(
                "kind 'inflight' is for save_weights_and_get_sampling_client; a named save is a snapshot"
            )
        elif req.path is None and req.sampling_session_seq_id is None:
            refusal = bad_request("save_weights_for_sampler needs either path (a name) or sampling_session_seq_id")
        if req.path is not None:
            return self._save(
                "sampler_weights",
                req.model_id,
                req.seq_id,
                req.path,
                owner,
                overwrite=False,
                ttl_seconds=req.ttl_seconds,
                user_metadata=req.user_metadata,
                refusal=refusal,
            )
        if refusal is not None:
            return self.training.refuse_ordered("save_weights_for_sampler", req.model_id, req.seq_id, refusal)
        return self.snapshots.save(req)

    def save_weights_external(self, req: wire.SaveWeightsExternalRequest, owner: str) -> str:
        """A PEFT adapter to download; with ``age_encryption_recipients``, each file encrypted
        to them (``core.encryption``)."""
        return self._save(
            "external_weights",
            req.model_id,
            req.seq_id,
            req.path,
            owner,
            overwrite=False,
            ttl_seconds=req.ttl_seconds,
            user_metadata=None,
            encrypt_to=req.age_encryption_recipients,
        )

    # ---- loading ----------------------------------------------------------------------------

    def _training_path(self, path: str, field: str = "path", *, adapter: bool = False) -> TinkerPath:
        """A training-state checkpoint that exists, or with ``adapter`` also an unencrypted
        external one (an export, an uploaded adapter: weights without optimizer state); errors
        name ``field``, the path's request field."""
        try:
            parsed = TinkerPath.parse(path, field)
        except CheckpointError as e:
            raise bad_request(str(e)) from None
        if parsed.kind == "external_weights" and not adapter:
            raise bad_request(
                f"{field} {path} is an adapter without optimizer state: load its weights only "
                "(create_training_client_from_state, load_state)"
            )
        if parsed.kind not in ("weights", "external_weights"):
            wanted = "a weights/ or external_weights/ path" if adapter else "a training-state weights/ path"
            raise bad_request(f"{field} {path} is a {parsed.checkpoint_type} checkpoint; this needs {wanted}")
        if self.store.get_checkpoint(parsed.run_id, parsed.kind, parsed.name) is None:
            raise not_found(f"{field}: checkpoint {path} does not exist")
        if self.files.encrypted(parsed):
            raise bad_request(f"{field} {path} is encrypted to its recipients: it cannot be loaded here")
        return parsed

    def _meta(self, path: TinkerPath) -> tuple[str, LoraSpec]:
        """Base model and LoRA shape of a checkpoint ``_training_path`` accepted: a training
        state says them itself, an adapter's come from the run it was saved in (or uploaded to)."""
        if path.kind == "external_weights":
            run = self.store.get_model(path.run_id)
            if run is None:
                raise not_found(f"checkpoint {path} does not exist")
            return run.base_model, LoraSpec(**run.lora)
        try:
            return training_meta(path, self.files.read(path, only=("training_state.json",)))
        except CheckpointError as e:
            raise bad_request(str(e)) from None

    def _state(self, path: TinkerPath, lora: LoraSpec) -> AdapterState:
        """What loading ``path`` puts into a model (on the worker: it reads the files)."""
        family = self.backend.capabilities.family
        if path.kind == "weights":
            return state_from_files(path, self.files.read(path), family).state
        weights = adapter_weights(self.files.read(path, only=(WEIGHTS,))[WEIGHTS], family)
        return AdapterState(lora, weights, {}, 0, torch.empty(0, dtype=torch.uint8))

    @staticmethod
    def _check_load_options(req: wire.LoadWeightsRequest) -> str | None:
        """The optimizer family the request names, if any."""
        if req.weights_access_token is not None:
            raise bad_request("weights_access_token is not supported: checkpoints here have no access tokens")
        if req.optimizer_config is None:
            return None
        if req.optimizer:
            raise bad_request(
                "optimizer_config is for a weights-only load: a load with optimizer state keeps the "
                "checkpoint's optimizer"
            )
        return optimizers.family(req.optimizer_config)

    def load_weights(self, req: wire.LoadWeightsRequest, owner: str) -> str:
        """Load a checkpoint into ``owner``'s model, or create one from it (``owner``'s limits
        checked with the checkpoint's rank once the request is known not to be a resend). The
        route checked that ``owner`` owns the model or session; here, that it may read ``path``."""
        try:
            self.tenancy.readable(owner, req.path, purpose="load")
        except ApiError as e:
            if req.model_id is None or req.seq_id is None:
                raise
            # The caller's own model: a checkpoint it may not read still uses up the seq_id.
            return self.training.refuse_ordered("load_weights", req.model_id, req.seq_id, e)
        if req.model_id is None:
            return self._create_via_load(req, owner)
        if req.seq_id is None:
            raise bad_request("load_weights on an existing model needs seq_id")

        def prepare(model: ModelRecord) -> Job:  # every refusal in here still consumes the seq_id
            named = self._check_load_options(req)
            path = self._training_path(req.path, adapter=not req.optimizer)
            mine = model_optimizer(model)
            if named is not None and named != mine:
                raise bad_request(
                    f"optimizer_config {named!r} cannot change the optimizer of model {model.model_id}, "
                    f"created with {mine!r}"
                )
            base_model, lora = self._meta(path)
            shape = ("rank", "train_attn", "train_mlp", "train_unembed")
            if any(getattr(lora, k) != model.lora[k] for k in shape):
                theirs = {k: getattr(lora, k) for k in shape}
                ours = {k: model.lora[k] for k in shape}
                raise bad_request(f"{path} holds a LoRA adapter {theirs}, but model {model.model_id} has {ours}")
            if base_model not in self.training.served_names:
                raise bad_request(f"{path} was trained on {base_model!r}, which is not served here")
            if req.optimizer and lora.optimizer != mine:
                raise bad_request(
                    f"{path} holds {lora.optimizer} optimizer state, but model {model.model_id} uses {mine}: "
                    "load its weights only (load_state), or create a training client from it"
                )
            # As the official service: a state is loaded only as a training client's first
            # request (seq_id 1), never into a model that has already been asked something.
            if req.seq_id != 1:
                raise bad_request(
                    f"LoadWeights is not permitted with seq_id {req.seq_id}: load_state is allowed only as a "
                    "training client's first request; to go on from a checkpoint, use "
                    "ServiceClient.create_training_client_from_state[_with_optimizer]"
                )

            def job() -> tuple[bytes, str]:
                self.backend.trainer.load_state(model.model_id, self._state(path, lora), with_optimizer=req.optimizer)
                self.training.events.weights_changed(model.model_id)
                return json_result({"path": str(path), "model_id": model.model_id, "type": "load_weights"})

            return job

        return self.training.submit_ordered("load_weights", req.model_id, req.seq_id, prepare)

    def _create_via_load(self, req: wire.LoadWeightsRequest, owner: str) -> str:
        """``create_training_client_from_state*``: a new model named ``{session}:train:{seq}``,
        with the checkpoint's optimizer when its state is loaded, else ``optimizer_config``'s."""
        named = self._check_load_options(req)
        if req.session_id is None or req.model_seq_id is None:
            raise bad_request("load_weights needs model_id, or session_id and model_seq_id to create a model")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        if (existing := self.scheduler.find(model_id, 0)) is not None:
            return existing
        path = self._training_path(req.path, adapter=not req.optimizer)
        base_model, lora = self._meta(path)
        if base_model not in self.training.served_names:
            raise bad_request(f"{path} was trained on {base_model!r}, which is not served here")
        if req.base_model is not None and req.base_model not in self.training.served_names:
            raise bad_request(f"base_model {req.base_model!r} is not served here")
        if not req.optimizer:
            lora = dataclasses.replace(lora, optimizer=named or "adamw")

        def load(new_model_id: str) -> None:
            self.backend.trainer.load_state(new_model_id, self._state(path, lora), with_optimizer=req.optimizer)

        return self.training.create_model_with(
            model_id,
            session_id=req.session_id,
            model_seq_id=req.model_seq_id,
            base_model=req.base_model or base_model,
            lora=lora,
            user_metadata=req.user_metadata or {},
            after_create=load,
            result={"path": str(path), "model_id": model_id, "type": "load_weights"},
            owner=owner,
        )

    def _record(self, run_id: str, checkpoint_id: str) -> tuple[TinkerPath, CheckpointRecord]:
        try:
            path = TinkerPath.from_checkpoint_id(run_id, checkpoint_id)
        except CheckpointError as e:
            raise bad_request(str(e)) from None
        record = self.store.get_checkpoint(path.run_id, path.kind, path.name)
        if record is None:
            raise not_found(f"checkpoint {path} does not exist")
        return path, record

    def delete(self, run_id: str, checkpoint_id: str, actor: str) -> None:
        path, _ = self._record(run_id, checkpoint_id)
        self._delete(path)
        self.events.deleted(Deleted(path, actor))

    def _delete(self, path: TinkerPath) -> None:
        # A mirrored checkpoint's row goes with its tombstone: never a moment in which a restart
        # would find the mirror's copy and no row, and restore what was deleted.
        mirrored = self.mirror.mirrors(path)
        self.store.delete_checkpoint(path.run_id, path.kind, path.name, mirrored=mirrored)
        self.files.delete(path)
        if mirrored:
            self.mirror.deleted(path)

    def set_public(self, run_id: str, checkpoint_id: str, public: bool, actor: str) -> None:
        path, _ = self._record(run_id, checkpoint_id)
        self.store.update_checkpoint(path.run_id, path.kind, path.name, public=int(public))
        self.events.changed(Changed(path, actor, "checkpoint_publish" if public else "checkpoint_unpublish"))

    def set_ttl(self, run_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
        path, _ = self._record(run_id, checkpoint_id)
        check_ttl(ttl_seconds)
        expires = time.time() + ttl_seconds if ttl_seconds is not None else None
        self.store.update_checkpoint(path.run_id, path.kind, path.name, expires_at=expires)
        self.events.changed(Changed(path, None))

    def weights_info(self, tinker_path: str) -> rsp.WeightsInfoResponse:
        """Base model and LoRA shape of any checkpoint: a training state's from its own record; a
        sampler's or an external one's (a PEFT adapter, which does not say all of it) from the
        run it was saved from, whose shape never changes."""
        try:
            path = TinkerPath.parse(tinker_path, "tinker_path")
        except CheckpointError as e:
            raise bad_request(str(e)) from None
        if path.kind == "weights":
            path = self._training_path(tinker_path, "tinker_path")
            try:
                described = describe_checkpoint(path, self.files.read(path, only=("training_state.json",)))
                return rsp.WeightsInfoResponse(**described)
            except CheckpointError as e:
                raise bad_request(str(e)) from None
        run = self.store.get_model(path.run_id)
        if run is None or self.store.get_checkpoint(path.run_id, path.kind, path.name) is None:
            raise not_found(f"tinker_path: checkpoint {tinker_path} does not exist")
        return rsp.WeightsInfoResponse(**describe_lora(run.base_model, LoraSpec(**run.lora)))

    # ---- downloads --------------------------------------------------------------------------

    def download_urls(
        self, run_id: str, checkpoint_id: str, base_url: str, tenant: str
    ) -> rsp.ExternalWeightsUrlsResponse:
        """Signed, expiring URLs for each file of an external-weights checkpoint (no auth needed),
        for ``tenant``'s key: they serve while that key may read it."""
        path, _ = self._record(run_id, checkpoint_id)
        if path.kind != "external_weights":
            raise bad_request(f"{path} is not an external_weights checkpoint")
        return self.links.urls(path, base_url, tenant)

    # ---- retention --------------------------------------------------------------------------

    def delete_expired(self) -> int:
        expired = self.store.expired_checkpoints(time.time())
        for record in expired:
            path = TinkerPath(record.model_id, record.kind, record.name)
            self._delete(path)
            self.events.deleted(Deleted(path, None, reason="ttl"))
        return len(expired)
