"""What a server finds wrong in its data directory at start-up it says once, clearly, and
refuses to start: a damaged or garbled database (never a raw traceback, never a damaged page
found later by whichever request reads it)."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.server import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _serve(data_dir: Path, model: Path, *flags: str) -> subprocess.CompletedProcess:
    return run_cli(["serve", "--port", "0", "--data-dir", str(data_dir), "--model", str(model), *flags], timeout=90)


def _keys_list(data_dir: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hosted_tinker", "keys", "list", "--data-dir", str(data_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("damage", ["garbled", "truncated", "bad page"])
def test_a_damaged_database_stops_the_start_with_a_clear_message(tmp_path: Path, tiny_model_dir: Path, damage):
    db_path = tmp_path / "hosted_tinker.sqlite"
    db = sqlite3.connect(db_path)
    db.execute("CREATE TABLE filler (x BLOB)")
    db.executemany("INSERT INTO filler VALUES (?)", [(bytes(4000),)] * 50)
    db.commit()
    db.close()
    data = bytearray(db_path.read_bytes())
    if damage == "garbled":
        data[:100] = b"x" * 100
    elif damage == "truncated":
        data = data[:50]
    else:  # a b-tree page of the table overwritten
        data[4096 * 3 : 4096 * 3 + 64] = b"\xff" * 64
    db_path.write_bytes(bytes(data))
    for result in (_serve(tmp_path, tiny_model_dir), _keys_list(tmp_path)):
        assert result.returncode != 0
        assert "Traceback" not in result.stderr, result.stderr[-2000:]
        assert str(db_path) in result.stderr and "backup" in result.stderr, result.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the ranks would start")
@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--device", "cuda"], r"the training worker could not start: "),
        (["--backend", "ddp", "--train-devices", "cuda:0,1"], r"training rank [01] could not start: "),
    ],
    ids=["one-worker", "group"],
)
def test_a_rank_that_cannot_start_stops_serve_with_its_reason_in_one_line(
    tmp_path: Path, tiny_model_dir: Path, flags: list[str], said: str
) -> None:
    """CUDA devices without a usable GPU (the CUDA image run without ``--gpus``): the rank logs its
    traceback, and serve exits 1 with the reason as its last line, not a traceback of its own."""
    started = _serve(tmp_path, tiny_model_dir, *flags)
    assert started.returncode == 1
    last = started.stderr.strip().splitlines()[-1]
    assert re.match(f"hosted-tinker serve: {said}", last), started.stderr[-2000:]
    assert "build_state" not in started.stderr  # no traceback from the gateway


def _database_with_rows_in_its_wal(db_path: Path) -> None:
    """A database whose last rows are in its ``-wal`` only, as a kill leaves it."""
    db = sqlite3.connect(db_path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.execute("CREATE TABLE filler (x BLOB)")
    db.executemany("INSERT INTO filler VALUES (?)", [(bytes(4000),)] * 50)
    wal = db_path.with_name(db_path.name + "-wal").read_bytes()
    db.close()  # checkpoints and removes the -wal: put it back as the kill would have left it
    db_path.with_name(db_path.name + "-wal").write_bytes(wal)


@pytest.mark.parametrize("damage", ["garbled", "flipped", "short", "no database"])
def test_a_garbage_wal_stops_the_start_like_a_garbage_database(tmp_path: Path, tiny_model_dir: Path, damage):
    """SQLite ignores a ``-wal`` whose header is not one (and deletes it): the server started
    silently empty, whatever the log held."""
    db_path = tmp_path / "hosted_tinker.sqlite"
    wal_path = tmp_path / "hosted_tinker.sqlite-wal"
    _database_with_rows_in_its_wal(db_path)
    if damage == "garbled":
        wal_path.write_bytes(b"garbage" * 1000)
    elif damage == "flipped":  # a byte of its header's salt: only its checksum tells
        data = bytearray(wal_path.read_bytes())
        data[17] ^= 0xFF
        wal_path.write_bytes(bytes(data))
    elif damage == "short":
        wal_path.write_bytes(wal_path.read_bytes()[:20])
    else:
        db_path.unlink()
    kept = wal_path.read_bytes()
    for result in (_serve(tmp_path, tiny_model_dir), _keys_list(tmp_path)):
        assert result.returncode != 0
        assert "Traceback" not in result.stderr, result.stderr[-2000:]
        assert str(wal_path) in result.stderr and "backup" in result.stderr, result.stderr[-2000:]
    assert wal_path.read_bytes() == kept  # left as it was, for whoever looks into it


def test_a_sound_wal_passes_the_check_and_its_rows_are_read(tmp_path: Path):
    """A ``-wal`` a kill left holds the database's last rows: the check lets it be."""
    from hosted_tinker.server.persistence.schema import check

    db_path = tmp_path / "hosted_tinker.sqlite"
    _database_with_rows_in_its_wal(db_path)
    check(db_path)
    assert sqlite3.connect(db_path).execute("SELECT COUNT(*) FROM filler").fetchone() == (50,)


def test_a_wal_never_written_is_let_be_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """From a review: a ``-wal`` of zeros (a power loss after the file grew, before its header was
    written) holds no commit, and SQLite opens the database past it; the check let it stop the
    start. It is now said, not refused."""
    from hosted_tinker.server.persistence.schema import check

    db_path = tmp_path / "hosted_tinker.sqlite"
    _database_with_rows_in_its_wal(db_path)
    db_path.with_name(db_path.name + "-wal").write_bytes(bytes(12 << 10))
    with caplog.at_level("WARNING"):
        check(db_path)
    assert "was never written (all zeros)" in caplog.text


def test_a_clean_stop_checkpoints_the_wal(tmp_path: Path, tiny_model_dir: Path):
    """A clean stop (SIGTERM) checkpoints the log into the database: it left 4 MB un-checkpointed."""
    from tests.support.server import start_server
    from tests.support.tenants import cli

    key = cli("keys", "create", "--data-dir", str(tmp_path), "--name", "alice")
    wal_path = tmp_path / "hosted_tinker.sqlite-wal"
    srv = start_server(tmp_path, "--model", str(tiny_model_dir))
    try:
        with httpx.Client(base_url=srv.base_url, headers={"X-API-Key": key}, timeout=30) as c:
            for _ in range(20):
                assert c.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).status_code == 200
        assert wal_path.stat().st_size > 0
    finally:
        srv.stop()
    assert not wal_path.exists() or wal_path.stat().st_size == 0
    assert "alice" in _keys_list(tmp_path).stdout


def test_a_checkpoint_that_names_code_of_its_own_stops_serve_saying_so(tmp_path: Path, tiny_model_dir: Path):
    """Kimi-K2's folder: ``model_type: kimi_k2``, its config class its own code (``auto_map``). No
    remote code runs here: serve exits with that as its last line, not transformers' advice to
    pass ``trust_remote_code``, which this server has no option for."""
    import json
    import shutil

    kimi = tmp_path / "kimi"
    shutil.copytree(tiny_model_dir, kimi)
    config = json.loads((kimi / "config.json").read_text())
    config |= {"model_type": "kimi_k2", "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}}
    (kimi / "config.json").write_text(json.dumps(config))
    started = _serve(tmp_path / "data", kimi)
    assert started.returncode == 1
    last = started.stderr.strip().splitlines()[-1]
    assert last.startswith("hosted-tinker serve: the training worker could not start: "), started.stderr[-2000:]
    assert "its config is code of the checkpoint's own (auto_map), which this server does not run" in last
