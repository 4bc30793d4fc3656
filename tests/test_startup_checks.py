"""What a server finds wrong in its data directory at start-up it says once, clearly, and
refuses to start: a damaged or garbled database (never a raw traceback, never a damaged page
found later by whichever request reads it)."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _serve(data_dir: Path, model: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hosted_tinker", "serve", "--port", "0", "--data-dir", str(data_dir)]
    return subprocess.run([*cmd, "--model", str(model), *flags], capture_output=True, text=True, timeout=90)


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
