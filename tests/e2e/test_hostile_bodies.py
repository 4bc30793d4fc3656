"""Request bodies one key sends cannot take the API process's memory from the others (an
attacker's audit): a 2,887-byte zstd body of 16.8 M empty datums OOM-killed the gateway, and
eight concurrent 120 MiB uploads from one key took 2.1 GB. Now the datums are counted as the body
is walked (``protocol.proto_scan``) and a key's bodies in flight are bounded (``api.inflight``),
checked here on a keyed server whose API process runs under a memory limit."""

from __future__ import annotations

import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from tests.support.cli import cli
from tests.support.server import ALIAS, ServerProcess, start_server
from tests.support.wire import Api, fwdbwd_body

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ATTACKER_BODY_BYTES = 256 << 10  # the attacker key's own body_bytes


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[tuple[ServerProcess, dict]]:
    data = tmp_path_factory.mktemp("bodies")
    create = ["keys", "create", "--data-dir", str(data), "--name"]
    keys = {
        "attacker": cli(*create, "attacker", f"--limit=body_bytes={ATTACKER_BODY_BYTES}").stdout.strip(),
        "victim": cli(*create, "victim").stdout.strip(),
    }
    srv = start_server(data, "--model", str(tiny_model_dir))
    yield srv, keys
    srv.stop()


def _api(srv: ServerProcess, key: str) -> Api:
    api = Api(srv.base_url)
    api.http.headers["X-API-Key"] = key
    return api


def _status(pid: int) -> dict[str, int]:
    """The process's memory figures from /proc, in KiB (VmHWM: its peak resident size)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines) if v.strip().endswith("kB")}


def test_a_compressed_bomb_is_refused_within_the_api_processs_memory(keyed):
    """The audit's bomb, sent with the API process held to 1 GiB more data than it has (its
    workers, started before, keep theirs): a 400 naming the bound, in seconds, the process's peak
    resident size up by less than 256 MiB, and another key trains at once after it."""
    srv, keys = keyed
    attacker = _api(srv, keys["attacker"])
    model_id = attacker.new_model()
    header = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy").SerializeToString()
    bomb = zstandard.ZstdCompressor(level=19).compress(header + b"\x1a\x00" * 16_800_000)
    assert len(bomb) < 4096

    pid = srv.proc.pid
    before = _status(pid)
    data_limit = (before["VmData"] << 10) + (1 << 30)
    old = resource.prlimit(pid, resource.RLIMIT_DATA, (data_limit, resource.RLIM_INFINITY))
    try:
        started = time.monotonic()
        r = attacker.post(
            "forward_backward",
            content=bomb,
            headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"},
        )
        took = time.monotonic() - started
    finally:
        resource.prlimit(pid, resource.RLIMIT_DATA, old)
    assert r.status_code == 400, r.text
    assert "data: over 4096 values in one ForwardBackwardRequest" in r.json()["detail"]
    assert took < 10
    assert (_status(pid)["VmHWM"] - before["VmHWM"]) << 10 < 256 << 20

    # The refused request used up its seq_id; the attacker's next one runs, and so does a victim's.
    assert attacker.result(attacker.fwdbwd(fwdbwd_body(model_id, 2)))
    with tinker.ServiceClient(base_url=srv.base_url, api_key=keys["victim"]) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
        )
        assert tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0


def _stalled_upload(srv: ServerProcess, key: str, declared: int) -> socket.socket:
    """A forward_backward upload that declares ``declared`` bytes and sends a few: its body is
    held (and counted) while the connection stays open."""
    host, port = srv.base_url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=10)
    head = (
        f"POST /api/v1/forward_backward HTTP/1.1\r\nHost: {host}\r\nX-API-Key: {key}\r\n"
        f"Content-Type: application/x-protobuf\r\nContent-Length: {declared}\r\n\r\n"
    )
    conn.sendall(head.encode() + b"\x0a")
    return conn


def test_a_long_poll_holds_nothing_while_it_waits(keyed):
    """From a review: a retrieve_future long poll held its few bytes for its 30 s, and a body
    that filled the key's share alone was refused whenever anything else of the key was held; the
    SDK polls a later request while it resends an earlier one, so both waited on each other for
    ever (429 on every try). A body is let go once it is read: the poll holds nothing."""
    srv, keys = keyed
    attacker = _api(srv, keys["attacker"])
    model_id = attacker.new_model()
    step = attacker.post("optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}})
    poll = threading.Thread(target=attacker.result, args=(step.json()["request_id"],), daemon=True)
    poll.start()  # waits for seq 1, in long polls
    body = fwdbwd_body(model_id, 1, n_datums=8, length=2048, forward_only=False)
    assert 2 * len(body) > ATTACKER_BODY_BYTES  # alone, over the key's share
    assert attacker.result(_api(srv, keys["attacker"]).fwdbwd(body))
    poll.join(timeout=60)
    assert not poll.is_alive()


def _held(srv: ServerProcess) -> dict:
    return httpx.get(f"{srv.base_url}/healthz", timeout=10).json()["body_bytes"]


def _wait_held(srv: ServerProcess, condition) -> dict:
    deadline = time.monotonic() + 30
    while not condition(held := _held(srv)):
        assert time.monotonic() < deadline, f"body bytes never came to the expected state: {held}"
    return held


def test_a_key_holds_at_most_its_share_of_bodies_in_flight(keyed):
    """While one of the attacker's uploads is being read, its next one is a 429 naming body_bytes
    if what it declares would not fit (Retry-After, body unread: the SDK resends it), and the
    victim's goes through; once the first is answered, the attacker's next upload is accepted
    again. A body holds what it has sent (twice, as it is read), not what it declares: a slow
    upload cannot hold the server's bound with a few bytes. A first body bigger than the key's
    share is not refused for it: alone, the body limits bound it, and a bound it could never fit
    would have the SDK resend it forever."""
    srv, keys = keyed
    attacker, victim = _api(srv, keys["attacker"]), _api(srv, keys["victim"])
    model_id = attacker.new_model()
    big = 3 * ATTACKER_BODY_BYTES // 4
    stalled = _stalled_upload(srv, keys["attacker"], big)
    try:
        held = _wait_held(srv, lambda h: h["held_bytes"] > 0 and h["keys_holding"] == 1)
        assert held["held_bytes"] == 2  # the one byte it sent, as read
        r = attacker.post("forward_backward", content=b"\x0a" * big, headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 429, r.text
        assert "limit body_bytes reached" in r.json()["detail"] and r.headers["Retry-After"] == "1"
        victims_model = victim.new_model()
        assert victim.result(victim.fwdbwd(fwdbwd_body(victims_model, 1)))
    finally:
        stalled.close()
    _wait_held(srv, lambda h: h["held_bytes"] == 0)
    # Alone, a body over the key's share is taken (and answered for what it is).
    body = fwdbwd_body(model_id, 1, n_datums=40, length=512, forward_only=True)
    assert len(body) > ATTACKER_BODY_BYTES
    assert attacker.result(attacker.fwdbwd(body))
