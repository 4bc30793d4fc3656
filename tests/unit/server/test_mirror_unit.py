"""``server.mirror`` on its own, with a directory standing in for the bucket and two data
directories for two VMs' disks: what a deletion, a change of a checkpoint's row, a lapsed TTL,
``copy_weights`` and a key made by ``hosted-tinker keys`` leave in the mirror, and what a start
restores from it. (``test_mirror.py`` runs the whole server and SDK against it.)"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from hosted_tinker.core.checkpoints import CheckpointFiles, TinkerPath
from hosted_tinker.server.keys import create_key
from hosted_tinker.server.mirror import RECORD, CheckpointMirror
from hosted_tinker.server.persistence.records import COPY_STATUS
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.quotas import Limits, Quotas
from hosted_tinker.server.serving.checkpoints import CheckpointService
from hosted_tinker.server.serving.copies import CopyService
from hosted_tinker.server.serving.events import CheckpointEvents
from hosted_tinker.server.serving.tenancy import Tenancy

pytestmark = [pytest.mark.fast, pytest.mark.timeout(60)]

SESSION, OWNER = "sess-a", "key-a"
RUN = f"{SESSION}:train:0"
STATE = TinkerPath(RUN, "weights", "step-1")


class Disk:
    """One VM's data directory: its store, its checkpoint files, and a mirror over the bucket."""

    def __init__(self, root: Path, bucket: Path) -> None:
        self.store = Store.in_data_dir(root)
        self.files = CheckpointFiles(root / "checkpoints")
        self.mirror = CheckpointMirror(f"file://{bucket}", self.files, self.store, keys_poll_s=0.05)
        # the service's own deletion (only its store, files and mirror take part in it)
        training = SimpleNamespace(backend=None, scheduler=None, store=self.store)
        self.events = CheckpointEvents()
        self.mirror.subscribe(self.events)
        self.service = CheckpointService(
            training,
            self.files,
            self.files,
            links=None,
            tenancy=Tenancy(self.store),
            events=self.events,
            mirror=self.mirror,
        )

    def save(self, path: TinkerPath = STATE, data: bytes = b"adapter", ttl_seconds: int | None = None) -> None:
        if self.store.session_owner(SESSION) is None:
            self.store.add_session(
                SESSION, owner=OWNER, tags=[], user_metadata={}, project_id=None, display_name=None, sdk_version=None
            )
            self.store.add_model(RUN, session_id=SESSION, model_seq_id=0, base_model="tiny", lora={}, user_metadata={})
        size = self.files.write(path, {"adapter_model.safetensors": data}, overwrite=True)
        self.store.put_checkpoint(
            path.run_id, path.kind, path.name, size_bytes=size, ttl_seconds=ttl_seconds, user_metadata={}
        )
        self.mirror.saved(path)

    def delete(self, path: TinkerPath = STATE) -> None:
        """A deletion as ``CheckpointService`` makes it, by its owner or its TTL."""
        self.service._delete(path)

    def settle(self) -> None:
        assert self.mirror.drain(time.monotonic() + 20), "the mirror's transfers did not finish"


def copied(bucket: Path, path: TinkerPath = STATE) -> dict | None:
    """The mirror's ``record.json`` of ``path``, if it holds a whole copy."""
    record = bucket / path.run_id / path.kind / path.name / RECORD
    return json.loads(record.read_text()) if record.exists() else None


def until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s"
        time.sleep(0.02)


@pytest.fixture()
def bucket(tmp_path: Path) -> Path:
    return tmp_path / "bucket"


@pytest.fixture()
def disk(tmp_path: Path, bucket: Path) -> Iterator[Callable[[str], Disk]]:
    """``disk(name)``: a VM's data directory over ``bucket``; their mirrors stop after the test
    (each polls the keys every 50 ms: left running, they would slow every test after this one)."""
    made: list[Disk] = []

    def make(name: str) -> Disk:
        made.append(Disk(tmp_path / name, bucket))
        return made[-1]

    yield make
    for each in made:
        each.mirror.close()


def test_a_deletion_the_mirror_missed_is_done_at_the_next_start_and_never_undone(
    tmp_path: Path, bucket: Path, disk: Callable[[str], Disk], monkeypatch
):
    a = disk("a")
    a.save()
    a.settle()
    assert copied(bucket) is not None
    with monkeypatch.context() as m:  # the network is down while the checkpoint is deleted
        m.setattr(a.mirror.fs, "rm_file", lambda *_: (_ for _ in ()).throw(OSError("unreachable")))
        a.delete()
        a.settle()
    assert a.mirror.failed == 1 and copied(bucket) is not None
    assert a.store.mirror_deletions() == [(STATE.run_id, STATE.kind, STATE.name)]

    again = disk("a")  # the same disk, started again
    assert again.mirror.sync() == (0, 0)  # not restored
    again.settle()
    assert copied(bucket) is None and not (bucket / RUN / "weights" / "step-1").exists()
    assert again.store.get_checkpoint(RUN, "weights", "step-1") is None
    assert again.store.mirror_deletions() == []


def test_a_crash_right_after_the_row_went_does_not_bring_the_checkpoint_back(
    tmp_path: Path, bucket: Path, disk: Callable[[str], Disk]
):
    a = disk("a")
    a.save()
    a.settle()
    a.store.delete_checkpoint(RUN, "weights", "step-1", mirrored=True)  # and the server dies here
    again = disk("a")
    assert again.mirror.sync() == (0, 0)
    again.settle()
    assert copied(bucket) is None and again.store.get_checkpoint(RUN, "weights", "step-1") is None


def test_saved_again_after_a_deletion_it_is_copied_up_and_kept(
    tmp_path: Path, bucket: Path, disk: Callable[[str], Disk]
):
    a = disk("a")
    a.save(data=b"first")
    a.delete()
    a.save(data=b"second")
    a.settle()
    assert copied(bucket) is not None and a.store.mirror_deletions() == []
    assert (bucket / RUN / "weights" / "step-1" / "adapter_model.safetensors").read_bytes() == b"second"


def test_publishing_and_a_new_ttl_rewrite_the_copy_s_record(tmp_path: Path, bucket: Path, disk: Callable[[str], Disk]):
    a = disk("a")
    a.save()
    a.settle()
    sha = copied(bucket)["manifest_sha256"]
    expires = time.time() + 3600
    a.store.update_checkpoint(RUN, "weights", "step-1", public=1, expires_at=expires)
    a.mirror.changed(STATE)
    a.settle()
    record = copied(bucket)
    assert record["checkpoint"]["public"] is True and record["checkpoint"]["expires_at"] == expires
    assert record["manifest_sha256"] == sha

    b = disk("b")  # a new VM
    assert b.mirror.sync() == (1, 0)
    restored = b.store.get_checkpoint(RUN, "weights", "step-1")
    assert restored.public and restored.expires_at == expires
    a.store.update_checkpoint(RUN, "weights", "step-1", public=0)  # unpublished: the copy follows
    a.mirror.changed(STATE)
    a.settle()
    assert copied(bucket)["checkpoint"]["public"] is False


def test_a_row_change_the_mirror_missed_is_made_at_the_next_start(
    tmp_path: Path, bucket: Path, disk: Callable[[str], Disk], monkeypatch
):
    a = disk("a")
    a.save()
    a.store.update_checkpoint(RUN, "weights", "step-1", public=1)
    a.mirror.changed(STATE)
    a.settle()
    with monkeypatch.context() as m:  # unpublished while the bucket cannot be reached
        m.setattr(a.mirror.fs, "mv", lambda *_: (_ for _ in ()).throw(OSError("unreachable")))
        a.store.update_checkpoint(RUN, "weights", "step-1", public=0)
        a.mirror.changed(STATE)
        a.settle()
    assert copied(bucket)["checkpoint"]["public"] is True  # stale: would publish it on a new VM
    again = disk("a")
    assert again.mirror.sync() == (0, 0)
    again.settle()
    assert copied(bucket)["checkpoint"]["public"] is False


def test_a_copy_whose_ttl_passed_is_not_restored_and_goes(tmp_path: Path, bucket: Path, disk: Callable[[str], Disk]):
    a = disk("a")
    a.save()
    a.store.update_checkpoint(RUN, "weights", "step-1", expires_at=time.time() - 1)  # lapsed, not yet swept
    a.mirror.changed(STATE)
    a.settle()
    b = disk("b")
    assert b.mirror.sync() == (0, 0)
    b.settle()
    assert b.store.get_checkpoint(RUN, "weights", "step-1") is None and copied(bucket) is None


def test_copy_weights_is_mirrored_and_restored_as_a_copy(tmp_path: Path, bucket: Path, disk: Callable[[str], Disk]):
    a = disk("a")
    a.save()
    copies = CopyService(a.store, a.files, Tenancy(a.store), Quotas(a.store, Limits(), max_lora_rank=64), a.events)
    request = wire.CopyWeightsRequest(session_id=SESSION, model_seq_id=1, source_path=str(STATE))
    target = TinkerPath.parse(copies.copy(request, OWNER, None).tinker_path)
    a.settle()
    assert copied(bucket, target)["model"]["status"] == COPY_STATUS

    b = disk("b")
    assert b.mirror.sync() == (2, 0)
    assert b.store.get_model(target.run_id).status == COPY_STATUS  # still not trainable
    assert b.store.get_model(RUN).status == "unloaded"


def test_an_uploaded_adapter_is_mirrored_and_an_export_is_not(
    tmp_path: Path, bucket: Path, disk: Callable[[str], Disk]
):
    a = disk("a")
    export = TinkerPath(RUN, "external_weights", "for-download")
    a.save(export)  # an export of a trained run: made for one download
    upload_run = "sess-upload-1:train:0"
    a.store.add_session(
        "sess-upload-1", owner=OWNER, tags=[], user_metadata={}, project_id=None, display_name=None, sdk_version=None
    )
    a.store.add_model(
        upload_run, session_id="sess-upload-1", model_seq_id=0, base_model="tiny", lora={}, user_metadata={}
    )
    a.store.set_model_status(upload_run, COPY_STATUS)  # as serving.uploads makes its run
    uploaded = TinkerPath(upload_run, "external_weights", "upload")
    a.save(uploaded)
    a.settle()
    assert copied(bucket, uploaded)["model"]["status"] == COPY_STATUS
    assert not (bucket / export.run_id / export.kind).exists()

    b = disk("b")
    assert b.mirror.sync() == (1, 0)
    assert b.store.get_model(upload_run).status == COPY_STATUS and b.files.exists(uploaded)


def test_a_key_made_while_the_server_runs_reaches_the_mirror_while_it_idles(
    tmp_path: Path, bucket: Path, disk: Callable[[str], Disk]
):
    a = disk("a")
    a.mirror.sync()  # copies up the (no) keys there are
    a.settle()
    cli = Store.in_data_dir(tmp_path / "a")  # `hosted-tinker keys create`: another connection
    key_id, _ = create_key(cli, "made-by-the-cli")

    def listed() -> bool:
        keys = bucket / "api_keys.json"
        return keys.exists() and key_id in {row["key_id"] for row in json.loads(keys.read_text())}

    until(listed, "the new key's row reaching the mirror")
