"""Bringing your own adapter (SDK 0.39's ``external_weights_upload_start`` / ``_finish``): the
files of a ``save_weights_external`` export, PUT one by one to signed URLs, checked against what
this server's export of that base model and LoRA shape holds, and kept as an ``external_weights``
checkpoint in a run of its own that cannot be trained on (as ``copy_weights``' runs), from which
a training client is created, a sampler samples, and the adapter is exported again.

- **start**: the base model must be served and the LoRA shape one this server makes. What the
  upload must hold (``Layout``) is read from real exports: adapters of those layers at ranks 1
  and 2 are made on the worker, exported as ``save_weights_external`` would, and dropped, once
  per set of layers (at most seven in a server's life), every rank's layout following from
  those two. The key's LoRA rank limit applies and its checkpoint bytes for an export of that
  size are reserved first; a key has at most ``MAX_PENDING_PER_KEY`` uploads open (or
  starting), the server ``MAX_PENDING``.
- **PUT**: each file to its URL (the URL is the credential, as a download link's), streamed to
  the staging directory, at most the export's size of that file (``Layout.max_bytes``).
- **finish**: every file checked (``core.adapter_layout``: config, tensor names, shapes, dtypes,
  finite values) before a checkpoint exists; refused, the upload is gone with its bytes and its
  reservation. Finished, the same ``upload_id`` answers the same path until it would have expired.

Open uploads are held in memory: a restart forgets them (their staged files are cleared with
the staging directory at start-up), as the service's signed URLs expire.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from hosted_tinker.core.adapter_layout import CONFIG, WEIGHTS, Layout, check_upload
from hosted_tinker.core.calls import on_rank_0
from hosted_tinker.core.checkpoints import CheckpointError, CheckpointFiles, TinkerPath, adapter_files
from hosted_tinker.core.errors import ApiError, bad_request, not_found, unavailable
from hosted_tinker.core.types import LoraSpec
from hosted_tinker.server.persistence.records import COPY_STATUS
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.protocol.responses import iso_time
from hosted_tinker.server.quotas import store_checkpoint
from hosted_tinker.server.serving.events import CheckpointEvents, Made
from hosted_tinker.server.serving.sessions import check_project_id
from hosted_tinker.server.serving.training import TrainingService

if TYPE_CHECKING:
    from hosted_tinker.server.quotas import Quotas, Reservation

log = logging.getLogger(__name__)
Groups = tuple[bool, bool, bool]  # an adapter's layers: train_attn, train_mlp, train_unembed

UPLOAD_TTL_S = 3600
MAX_PENDING_PER_KEY = 4
MAX_PENDING = 256
MAX_FINISHING = 2  # finishes checked at once: each reads its files whole (about three times their size)
CHECKPOINT_NAME = "upload"  # the checkpoint's name in the run made for it
_SIGNED = "external-weights-upload"  # in every signed payload: a download link's signature is not an upload's


@dataclass
class Upload:
    upload_id: str
    tenant: str
    base_model: str
    lora: LoraSpec
    project_id: str | None
    layout: Layout
    expires: float
    staging: Path
    held: Reservation | None
    received: set[str] = field(default_factory=set)
    writing: set[str] = field(default_factory=set)  # one PUT of each file at a time: a file's disk is bounded
    busy: bool = False  # being finished: no more files, no second finish


@dataclass(frozen=True)
class Receiving:
    """Where a PUT's bytes go (``partial``, renamed to ``final`` once all of it came) and how many it may be."""

    upload: Upload
    name: str
    partial: Path
    final: Path
    max_bytes: int


class UploadService:
    def __init__(
        self,
        training: TrainingService,
        files: CheckpointFiles,
        secret: bytes,
        quotas: Quotas | None = None,
        *,
        may_upload: Callable[[str], bool] | None = None,
        events: CheckpointEvents | None = None,
    ) -> None:
        self.training = training
        self.store = training.store
        self.files = files
        self.quotas = quotas
        self.may_upload = may_upload  # whether a key (still) may: a revoked key's URLs stop taking bytes
        self.events = events if events is not None else CheckpointEvents()
        self._secret = secret
        self._lock = threading.Lock()  # the open uploads: read by the event loop and finishing threads
        self._open: dict[str, Upload] = {}
        self._starting: dict[str, int] = {}  # per key: starts waiting for their layout
        self._finished: dict[str, tuple[str, str, float]] = {}  # upload_id -> (tenant, tinker path, until)
        self._exports: dict[Groups, asyncio.Future[tuple[Layout, Layout]]] = {}
        self.finishing = asyncio.Semaphore(MAX_FINISHING)

    # ---- start ----------------------------------------------------------------------------

    async def start(
        self, req: wire.ExternalWeightsUploadStartRequest, tenant: str, base_url: str
    ) -> rsp.ExternalWeightsUploadStartResponse:
        if req.base_model not in self.training.served_names:
            raise bad_request(f"base_model {req.base_model!r} is not served here; served: {self.training.served_names}")
        if req.destination_project_id is not None:
            check_project_id(req.destination_project_id)
        lora = self.training.lora_spec(req.lora_config)
        await asyncio.to_thread(self.expire)
        with self._lock:
            self._check_room(tenant)
            self._starting[tenant] = self._starting.get(tenant, 0) + 1  # counted while it waits
        held = upload = None
        try:
            # Reserved before any adapter is made on the worker: a key cannot have one made that
            # it could not store (nor of a rank above its own limit).
            held = self.quotas.reserve_upload(tenant, lora) if self.quotas is not None else None
            layout = await self._layout(lora)
            if held is not None:
                held.settle(sum(layout.sizes.values()))  # the export's true size (its headers too)
            upload_id = f"upload-{secrets.token_hex(16)}"
            upload = Upload(
                upload_id,
                tenant,
                req.base_model,
                lora,
                req.destination_project_id,
                layout,
                time.time() + UPLOAD_TTL_S,
                self.files.staging_dir(upload_id),
                held,
            )
            with self._lock:
                self._open[upload_id] = upload
        except BaseException:
            if upload is not None:
                self._discard(upload)
            elif held is not None:
                held.release()
            raise
        finally:
            with self._lock:
                self._starting[tenant] -= 1
                if not self._starting[tenant]:
                    del self._starting[tenant]
        at = f"{base_url}/api/v1/uploads/{upload_id}"
        urls = {name: f"{at}/{self._sign(upload_id, name)}/{name}" for name in layout.sizes}
        return rsp.ExternalWeightsUploadStartResponse(
            upload_id=upload_id, urls=urls, expires=iso_time(upload.expires).isoformat()
        )

    def _check_room(self, tenant: str) -> None:
        mine = sum(u.tenant == tenant for u in self._open.values()) + self._starting.get(tenant, 0)
        if mine >= MAX_PENDING_PER_KEY:
            raise ApiError(
                403,
                f"this key has {mine} adapter uploads open, the most it may: finish them, or let them expire "
                f"({UPLOAD_TTL_S} s after their start)",
            )
        if len(self._open) + sum(self._starting.values()) >= MAX_PENDING:
            raise ApiError(503, "the server holds as many open adapter uploads as it takes; try again later")

    async def _layout(self, lora: LoraSpec) -> Layout:
        """What an export of an adapter of ``lora``'s shape holds: from exports of its layers at
        ranks 1 and 2, made on the worker once (starts that ask meanwhile wait for the same)."""
        groups = (lora.train_attn, lora.train_mlp, lora.train_unembed)
        made = self._exports.get(groups)
        if made is None:
            made = self._exports[groups] = asyncio.wrap_future(self._export_pair(lora))
        try:
            one, two = await asyncio.shield(made)  # a start whose client left does not cancel the others'
            return Layout.at_rank(one, two, lora.rank)
        except Exception as e:
            if self._exports.get(groups) is made:
                del self._exports[groups]  # made again by the next start
            log.exception("the layout of an adapter upload could not be made")
            raise unavailable(f"the adapter's layout could not be made on the worker ({type(e).__name__})", 5) from None

    def _export_pair(self, lora: LoraSpec) -> concurrent.futures.Future[tuple[Layout, Layout]]:
        """Exports of adapters of ``lora``'s layers at ranks 1 and 2, made and dropped on the worker
        thread between other jobs (no model holds them: nothing to park, no seq_id)."""
        trainer, family = self.training.backend.trainer, self.training.backend.capabilities.family
        done: concurrent.futures.Future[tuple[Layout, Layout]] = concurrent.futures.Future()

        def export(rank: int) -> Layout:
            model_id = f"upload-layout-{secrets.token_hex(8)}"
            trainer.create_adapter(model_id, LoraSpec(rank, 0, lora.train_mlp, lora.train_attn, lora.train_unembed))
            try:
                config = trainer.peft_config(model_id)
                state = on_rank_0(trainer.export_state(model_id, with_optimizer=False))
            finally:
                trainer.delete_adapter(model_id)
            return Layout.of_export(adapter_files(config, state.weights, family))

        def run() -> None:
            try:
                done.set_result((export(1), export(2)))
            except BaseException as e:
                done.set_exception(e)

        self.training.scheduler.run_on_worker(run)
        return done

    # ---- files ----------------------------------------------------------------------------

    def _sign(self, upload_id: str, name: str) -> str:
        payload = json.dumps([_SIGNED, upload_id, name])
        return hmac.new(self._secret, payload.encode(), hashlib.sha256).hexdigest()[:32]

    def receiving(self, upload_id: str, signature: str, name: str) -> Receiving:
        """Where a PUT to a signed URL writes, if the signature holds and its upload is open."""
        if len(signature) > 64 or not hmac.compare_digest(self._sign(upload_id, name).encode(), signature.encode()):
            raise ApiError(403, "this upload URL is invalid")
        with self._lock:
            upload = self._open.get(upload_id)
        if (
            upload is None
            or upload.expires < time.time()
            or name not in upload.layout.sizes
            or (self.may_upload is not None and not self.may_upload(upload.tenant))  # revoked since
        ):
            raise not_found("no such upload: it was finished, refused, or has expired")
        with self._lock:
            if upload.busy:
                raise ApiError(409, f"upload {upload_id} is being finished; its files can no longer change")
            if name in upload.writing:
                raise ApiError(409, f"{name} of upload {upload_id} is being PUT already; PUT it again once that ends")
            upload.writing.add(name)
        partial = upload.staging / f".{name}.{secrets.token_hex(4)}"
        return Receiving(upload, name, partial, upload.staging / name, upload.layout.max_bytes(name))

    def received(self, receiving: Receiving) -> None:
        """A PUT's bytes all came: they are the file now (a second PUT of it replaces the first)."""
        with self._lock:
            if receiving.upload.busy or receiving.upload.upload_id not in self._open:
                raise ApiError(409, f"upload {receiving.upload.upload_id} is being finished or is gone")
            os.replace(receiving.partial, receiving.final)
            receiving.upload.received.add(receiving.name)

    def ended(self, receiving: Receiving) -> None:
        """A PUT ended, whole or not: what it left half-written goes."""
        receiving.partial.unlink(missing_ok=True)
        with self._lock:
            receiving.upload.writing.discard(receiving.name)

    # ---- finish ---------------------------------------------------------------------------

    def finish(self, upload_id: str, tenant: str) -> rsp.ExternalWeightsUploadFinishResponse:
        """The checkpoint made of an upload's files, if they hold the adapter it was started for;
        else a 400 naming what differs, and nothing of the upload is left. Reads and checks
        every byte: call it off the event loop."""
        with self._lock:
            done = self._finished.get(upload_id)
            if done is not None and done[0] == tenant:
                return rsp.ExternalWeightsUploadFinishResponse(
                    tinker_path=done[1]
                )  # a retry of a finish that succeeded
            upload = self._open.get(upload_id)
            if upload is None or upload.tenant != tenant or upload.expires < time.time():
                raise not_found(f"upload_id {upload_id!r}: no such upload open (finished, refused or expired)")
            if upload.busy:
                raise ApiError(409, f"upload {upload_id} is already being finished")
            upload.busy = True
        try:
            files = {name: (upload.staging / name).read_bytes() for name in upload.received}
            try:
                check_upload(upload.layout, files)
            except CheckpointError as e:
                raise bad_request(f"upload {upload_id}: {e}") from None
            except (ValueError, TypeError, OverflowError, RecursionError) as e:  # the files are the sender's
                raise bad_request(f"upload {upload_id}: the files could not be read ({type(e).__name__})") from None
            config = upload.layout.config | {"base_model_name_or_path": upload.base_model}
            stored = {CONFIG: json.dumps(config, indent=2).encode(), WEIGHTS: files[WEIGHTS]}
            path = self._store(upload, stored)
        finally:
            with self._lock:
                self._open.pop(upload_id, None)
            self._discard(upload)
        with self._lock:
            self._finished[upload_id] = (tenant, str(path), upload.expires)
        return rsp.ExternalWeightsUploadFinishResponse(tinker_path=str(path))

    def _store(self, upload: Upload, files: dict[str, bytes]) -> TinkerPath:
        """A finished session of the key's, whose run 0 holds the adapter as its one checkpoint."""
        session_id = f"sess-upload-{secrets.token_hex(10)}"
        run_id = f"{session_id}:train:0"
        path = TinkerPath(run_id, "external_weights", CHECKPOINT_NAME)
        size = sum(len(data) for data in files.values())

        def record() -> None:
            self.store.add_session(
                session_id,
                owner=upload.tenant,
                tags=["external_weights_upload"],
                user_metadata={"upload_id": upload.upload_id},
                project_id=upload.project_id,
                display_name=f"adapter uploaded for {upload.base_model}",
                sdk_version=None,
            )
            self.store.finish_session(session_id, "finished:success")
            self.store.add_model(
                run_id,
                session_id=session_id,
                model_seq_id=0,
                base_model=upload.base_model,
                lora=upload.lora.__dict__,
                user_metadata={},
            )
            self.store.set_model_status(run_id, COPY_STATUS)
            self.store.put_checkpoint(run_id, path.kind, path.name, size_bytes=size, ttl_seconds=None, user_metadata={})

        held, upload.held = upload.held, None  # from here this save settles or releases it
        write = partial(self.files.write, path, files, overwrite=False)
        store_checkpoint(held, size, write, record, undo=partial(self.files.delete, path))
        # The checkpoint is made: what follows cannot turn its finish into an error (``events.Topic``).
        self.events.made(Made(path, upload.tenant, size, self.files, "upload", {"uploaded": True}))
        return path

    # ---- retention ------------------------------------------------------------------------

    def expire(self) -> int:
        """Forget uploads past their expiry (their bytes and reservations go) and finished ones'
        answers; returns how many open ones went."""
        now = time.time()
        with self._lock:
            gone = [u for u in self._open.values() if u.expires < now and not u.busy]
            for upload in gone:
                del self._open[upload.upload_id]
            self._finished = {k: v for k, v in self._finished.items() if v[2] >= now}
        for upload in gone:
            self._discard(upload)
        return len(gone)

    @staticmethod
    def _discard(upload: Upload) -> None:
        shutil.rmtree(upload.staging, ignore_errors=True)
        if upload.held is not None:
            upload.held.release()
            upload.held = None
