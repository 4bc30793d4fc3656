"""An object-storage mirror of saved checkpoints (``--checkpoint-mirror URL``): runs outlive the
VM. Any fsspec URL: ``gs://bucket/prefix`` (with gcsfs), ``s3://...``, ``file:///path``.

- Every training-state and sampler checkpoint saved here (or copied by ``copy_weights``) is
  copied there, its files, its SHA-256 manifest, and last ``record.json`` (its run, session
  owner and checkpoint row), whose presence marks a complete copy. A change to the row
  (published, unpublished, a new TTL) rewrites ``record.json``; a start rewrites any that
  missed one (the mirror's row must never publish what the owner unpublished).
- A checkpoint deleted here (or past its TTL) is deleted there. Until it is, the store keeps a
  tombstone (``mirror_deletions``), so that a start after a failed or unfinished deletion deletes
  the copy rather than restoring it; a copy whose TTL has passed is not restored either.
- At start, a server restores every checkpoint the mirror holds and its disk lacks (a new VM):
  each file checked against the manifest, the rows made again under the same ids and owner
  (the run as ``unloaded``: load it with ``create_training_client_from_state``). It also copies
  up what the mirror lacks (a failed upload, or a mirror turned on later).
- The API keys' rows (hashes, never keys) are copied up after each change the server makes, and
  within ``KEYS_POLL_S`` of one made by ``hosted-tinker keys`` while the server runs.
- Deletion: ``Store.delete_checkpoint(mirrored=True)`` removes the row and writes the tombstone in
  one transaction, then ``deleted`` queues the copy's removal.

Transfers run in order on a thread of their own, so that no save waits for the network; one
that fails is logged and done again at the next start.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hosted_tinker.core.checkpoints import MANIFEST, CheckpointFiles, TinkerPath
from hosted_tinker.server.persistence.records import COPY_STATUS
from hosted_tinker.server.persistence.store import Store

if TYPE_CHECKING:
    from hosted_tinker.server.serving.events import CheckpointEvents

log = logging.getLogger(__name__)

RECORD = "record.json"
KEYS = "api_keys.json"  # the keys' rows: a new VM's server restores the tenants with their runs
MIRRORED = ("weights", "sampler_weights")  # exports (external_weights) are made for one download: not those
KEYS_POLL_S = 30.0  # how often the keys are compared with what was last copied up
ROW = ("public", "expires_at", "user_metadata")  # what of a checkpoint's row can change after its save


class NoMirror:
    """Without ``--checkpoint-mirror``: nothing is copied up, so a deletion leaves no tombstone."""

    def mirrors(self, path: TinkerPath) -> bool:
        return False

    def deleted(self, path: TinkerPath) -> None:
        """Nothing was copied up: nothing to delete."""

    def status(self) -> None:
        return None  # /healthz shows no mirror

    def drain(self, deadline: float) -> bool:
        return True  # nothing is ever queued

    def close(self) -> None:
        """Nothing runs."""


NO_MIRROR = NoMirror()


class CheckpointMirror:
    def __init__(self, url: str, files: CheckpointFiles, store: Store, keys_poll_s: float = KEYS_POLL_S) -> None:
        import fsspec  # a dependency; gcsfs or s3fs only for their URLs

        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.files = files
        self.store = store
        self.keys_poll_s = keys_poll_s
        self.uploaded = self.deleted_total = self.failed = 0
        self._keys_copied: bytes | None = None  # api_keys.json as last copied up
        self._queue: queue.Queue[Callable[[], None]] = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-mirror", daemon=True)
        self._thread.start()

    def status(self) -> dict:
        return {"url": self.url, "uploaded": self.uploaded, "deleted": self.deleted_total, "failed": self.failed}

    def _dir(self, path: TinkerPath) -> str:
        return f"{self.root}/{path.run_id}/{path.kind}/{path.name}"

    # ---- what the server tells it ---------------------------------------------------------

    def mirrors(self, path: TinkerPath) -> bool:
        """Whether the checkpoint at ``path`` is copied up: training states and sampler adapters,
        and an adapter uploaded here (``serving.uploads``: the one checkpoint of a run that holds
        weights made elsewhere), not an export."""
        if path.kind in MIRRORED:
            return True
        run = self.store.get_model(path.run_id) if path.kind == "external_weights" else None
        return run is not None and run.status == COPY_STATUS

    def subscribe(self, events: CheckpointEvents) -> None:
        """Hear of every checkpoint made and every row changed (``serving.events``); a deletion
        comes with its row's (``CheckpointService._delete``: the tombstone goes with it)."""
        events.made.subscribe(lambda e: self.saved(e.path))
        events.changed.subscribe(lambda e: self.changed(e.path))

    def saved(self, path: TinkerPath) -> None:
        if self.mirrors(path):
            self.store.clear_mirror_deletion(path)  # saved again after a deletion
            self._queue.put(lambda: self._upload(path))
            self._queue.put(self._upload_keys)  # its owner's key is there by the time its copy is

    def changed(self, path: TinkerPath) -> None:
        """Its row changed (public, expiry): the copy's ``record.json`` follows."""
        if self.mirrors(path):
            self._queue.put(lambda: self._upload_record(path))

    def deleted(self, path: TinkerPath) -> None:
        """Deleted here, its row gone with a tombstone (``Store.delete_checkpoint(mirrored=True)``):
        the copy goes too, and the tombstone when it has."""
        if self.mirrors(path):
            self._queue.put(lambda: self._delete(path))

    def drain(self, deadline: float) -> bool:
        """Wait until everything asked so far is done, or ``deadline`` (monotonic) passes (at
        shutdown); whether it was all done."""
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 5.0) -> None:
        """Stop the transfer thread, after ``drain``: what is still queued is done at the next
        start. A transfer under way is waited for up to ``timeout`` (the thread is a daemon)."""
        self._closed.set()
        self._queue.put(lambda: None)  # wakes it from its wait
        self._thread.join(timeout)

    def _run(self) -> None:
        keys_due = time.monotonic() + self.keys_poll_s
        while not self._closed.is_set():
            if time.monotonic() >= keys_due:  # keys changed by `hosted-tinker keys` go up, busy or not
                keys_due = time.monotonic() + self.keys_poll_s
                try:
                    self._upload_keys()
                except Exception:
                    log.exception("checkpoint mirror %s: the API keys could not be copied up", self.url)
            try:
                task = self._queue.get(timeout=max(0.0, keys_due - time.monotonic()))
            except queue.Empty:
                continue
            try:
                task()
            except Exception:
                self.failed += 1
                log.exception("checkpoint mirror %s: a transfer failed (done again at the next start)", self.url)
            finally:
                self._queue.task_done()

    # ---- transfers --------------------------------------------------------------------------

    def _upload(self, path: TinkerPath) -> None:
        record = self._record(path)
        if record is None:  # deleted before its turn came
            return
        directory, target = self.files.directory(path), self._dir(path)
        # The record goes first and comes back last: a copy half-made (or half-replaced by an
        # overwrite) is never taken for a whole one.
        if self.fs.exists(f"{target}/{RECORD}"):
            self.fs.rm_file(f"{target}/{RECORD}")
        files = self.files.read(path)  # checked against its manifest: one version, whole
        self.fs.makedirs(target, exist_ok=True)  # a no-op on object stores; needed on a filesystem
        for name, data in files.items():
            self.fs.pipe_file(f"{target}/{name}", data)
        manifest = (directory / MANIFEST).read_bytes()
        if json.loads(manifest)["files"].keys() != files.keys():  # overwritten while read: next time
            raise RuntimeError(f"{path} changed while it was copied")
        self.fs.pipe_file(f"{target}/{MANIFEST}", manifest)
        record["manifest_sha256"] = hashlib.sha256(manifest).hexdigest()
        self.fs.pipe_file(f"{target}/{RECORD}", json.dumps(record).encode())
        self.uploaded += 1

    def _upload_record(self, path: TinkerPath) -> None:
        target = f"{self._dir(path)}/{RECORD}"
        record = self._record(path)
        if record is None or not self.fs.exists(target):  # gone, or not whole there yet: its upload
            return  # (queued, or done at the next start) carries the row as it is then
        record["manifest_sha256"] = json.loads(self.fs.cat_file(target)).get("manifest_sha256")
        # Written aside, then moved over: the marker of a whole copy is never half-written.
        self.fs.pipe_file(f"{target}.partial", json.dumps(record).encode())
        self.fs.mv(f"{target}.partial", target)

    def _delete(self, path: TinkerPath) -> None:
        target = self._dir(path)
        if self.fs.exists(f"{target}/{RECORD}"):
            self.fs.rm_file(f"{target}/{RECORD}")  # first: a half-deleted copy is never restored
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)
        if self.store.get_checkpoint(path.run_id, path.kind, path.name) is None:  # not saved again since
            self.store.clear_mirror_deletion(path)
        self.deleted_total += 1

    def _record(self, path: TinkerPath) -> dict | None:
        checkpoint = self.store.get_checkpoint(path.run_id, path.kind, path.name)
        model = self.store.get_model(path.run_id)
        if checkpoint is None or model is None:
            return None
        return {
            "session_id": model.session_id,
            "owner": self.store.session_owner(model.session_id),
            "model": {
                "model_id": model.model_id,
                "status": model.status,
                "model_seq_id": model.model_seq_id,
                "base_model": model.base_model,
                "lora": model.lora,
                "user_metadata": model.user_metadata,
            },
            "checkpoint": {
                "kind": path.kind,
                "name": path.name,
                "created_at": checkpoint.created_at,
                "expires_at": checkpoint.expires_at,
                "public": checkpoint.public,
                "user_metadata": checkpoint.user_metadata,
            },
        }

    # ---- at start ---------------------------------------------------------------------------

    def sync(self) -> tuple[int, int]:
        """Restore what only the mirror has, and queue the upload of what only the disk has;
        returns (restored, queued). Runs before the server takes requests."""
        restored, mirrored = 0, {}  # path -> its copy's record
        self._restore_keys()
        deleted = {TinkerPath(*row) for row in self.store.mirror_deletions()}
        for path in deleted:  # a deletion that failed, or had not run when the server stopped
            self._queue.put(functools.partial(self._delete, path))
        now = time.time()
        for record_path in self.fs.glob(f"{self.root}/*/*/*/{RECORD}"):
            try:
                record = json.loads(self.fs.cat_file(record_path))
                checkpoint = record["checkpoint"]
                path = TinkerPath(record["model"]["model_id"], checkpoint["kind"], checkpoint["name"])
                if path in deleted:
                    continue
                if self.store.get_checkpoint(path.run_id, path.kind, path.name) is None:
                    if checkpoint["expires_at"] is not None and checkpoint["expires_at"] <= now:
                        self._queue.put(functools.partial(self._delete, path))  # its TTL passed while away
                        continue
                    restored += self._restore(path, record)
                mirrored[path] = record
            except Exception:  # one bad copy must not keep the server from starting
                log.exception("checkpoint mirror: %s cannot be restored", record_path)
        queued = 0
        for checkpoint in self.store.list_checkpoints():
            path = TinkerPath(checkpoint.model_id, checkpoint.kind, checkpoint.name)
            if not self.mirrors(path):
                continue
            copy = mirrored.get(path)
            if copy is None or copy.get("manifest_sha256") != self._manifest_sha256(path):
                self.saved(path)  # missing there, or an older version (an overwrite not copied up)
                queued += 1
            elif {k: copy["checkpoint"][k] for k in ROW} != {k: getattr(checkpoint, k) for k in ROW}:
                self.changed(path)  # a publish or TTL change whose rewrite did not happen
        return restored, queued

    def _manifest_sha256(self, path: TinkerPath) -> str | None:
        try:
            return hashlib.sha256((self.files.directory(path) / MANIFEST).read_bytes()).hexdigest()
        except OSError:
            return None

    # ---- the keys, so that a new VM's server knows the tenants its restored runs belong to ------

    def keys_saved(self) -> None:
        """Copy the API keys' rows (hashes, never keys) up, after any change to them."""
        self._queue.put(self._upload_keys)

    def _upload_keys(self) -> None:
        """Copy the keys' rows up, unless they are what was last copied."""
        rows = [{**k.__dict__, "sha256": self.store.api_key_hash(k.key_id)} for k in self.store.list_api_keys()]
        for row in rows:
            row["limits"] = self.store.api_key_limits(row["key_id"])
        data = json.dumps(rows).encode()
        if data != self._keys_copied:
            self.fs.makedirs(self.root, exist_ok=True)  # as in _upload
            self.fs.pipe_file(f"{self.root}/{KEYS}", data)
            self._keys_copied = data

    def _restore_keys(self) -> None:
        if not self.fs.exists(f"{self.root}/{KEYS}"):
            self.keys_saved()
            return
        known = {k.key_id for k in self.store.list_api_keys()}
        for row in json.loads(self.fs.cat_file(f"{self.root}/{KEYS}")):
            if row["key_id"] not in known:
                self.store.add_api_key(row["key_id"], name=row["name"], sha256=row["sha256"], prefix=row["prefix"])
                self.store.set_api_key_limits(row["key_id"], row["limits"])
                if row["revoked_at"] is not None:
                    self.store.revoke_api_key(row["key_id"])
                log.info("checkpoint mirror: restored API key %s (%s)", row["key_id"], row["name"])
        self.keys_saved()  # and this server's own, made before the mirror was read

    def _restore(self, path: TinkerPath, record: dict) -> bool:
        source = self._dir(path)
        manifest = json.loads(self.fs.cat_file(f"{source}/{MANIFEST}"))["files"]
        files = {}
        for name, expected in manifest.items():
            files[name] = data = self.fs.cat_file(f"{source}/{name}")
            if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
                log.error("checkpoint mirror: %s/%s fails its SHA-256 check; %s is not restored", source, name, path)
                return False
        size = self.files.write(path, files, overwrite=True)
        model, checkpoint = record["model"], record["checkpoint"]
        if self.store.session_owner(record["session_id"]) is None:
            self.store.add_session(
                record["session_id"],
                owner=record["owner"] or "",
                tags=["restored"],
                user_metadata={"restored_from": self.url},
                project_id=None,
                display_name=None,
                sdk_version=None,
            )
            self.store.finish_session(record["session_id"], "finished:interrupted")
        if self.store.get_model(path.run_id) is None:
            self.store.add_model(
                path.run_id,
                session_id=record["session_id"],
                model_seq_id=model["model_seq_id"],
                base_model=model["base_model"],
                lora=model["lora"],
                user_metadata=model["user_metadata"],
            )
            copy = model.get("status") == COPY_STATUS  # holds copy_weights: stays untrainable
            self.store.set_model_status(path.run_id, COPY_STATUS if copy else "unloaded")
        self.store.put_checkpoint(
            path.run_id,
            path.kind,
            path.name,
            size_bytes=size,
            ttl_seconds=None,
            user_metadata=checkpoint["user_metadata"],
        )
        self.store.update_checkpoint(
            path.run_id,
            path.kind,
            path.name,
            created_at=checkpoint["created_at"],
            expires_at=checkpoint["expires_at"],
            public=int(checkpoint["public"]),
        )
        log.info("checkpoint mirror: restored %s", path)
        return True
