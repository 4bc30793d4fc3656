"""Slow and oversized clients (``server.api.connections``): headers trickled a byte at a time,
headers past the size bound and a stalled body are cut off, while SDK training, kept-alive
clients and pipelined requests go on as before. One server with short limits for the module."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS, ServerProcess, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0
MIN_BODY_RATE = 1000  # bytes/s
MARGIN = 2.5  # seconds of slack on a loaded 2-core machine


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerProcess]:
    server = start_server(
        tmp_path_factory.mktemp("slow-clients"),
        "--model",
        str(tiny_model_dir),
        "--header-timeout",
        str(HEADER_TIMEOUT),
        "--body-timeout",
        str(BODY_TIMEOUT),
        "--min-body-rate",
        str(MIN_BODY_RATE),
    )
    yield server
    server.stop()


def connect(srv: ServerProcess) -> socket.socket:
    host, port = srv.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """All the server sends until it closes the connection (a reset counts as closed)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


class Trickler:
    """``n`` connections, each sending a request head one byte per ``every`` seconds from one
    thread; each one the server closes is replaced, and its lifetime recorded."""

    HEAD = b"GET /api/v1/healthz HTTP/1.1\r\nHost: slow\r\nX-Padding: " + b"a" * 200 + b"\r\n\r\n"

    def __init__(self, srv: ServerProcess, n: int, every: float) -> None:
        self.srv, self.n, self.every = srv, n, every
        self.sel = selectors.DefaultSelector()
        self.lifetimes: list[float] = []
        self.answers: list[bytes] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> None:
        sock = connect(self.srv)
        sock.setblocking(False)
        self.sel.register(sock, selectors.EVENT_READ, [time.monotonic(), 0, b""])  # opened, sent, received

    def _closed(self, key: selectors.SelectorKey) -> None:
        opened, _, received = key.data
        self.lifetimes.append(time.monotonic() - opened)
        self.answers.append(received)
        self.sel.unregister(key.fileobj)
        key.fileobj.close()

    def _run(self) -> None:
        try:
            self._trickle()
        except BaseException as e:  # reported by the test
            self.error = e

    def _trickle(self) -> None:
        for _ in range(self.n):
            self._open()
        next_byte = time.monotonic()
        while True:
            for key, _ in self.sel.select(timeout=0.05):
                try:
                    chunk = key.fileobj.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if chunk:
                    key.data[2] += chunk
                else:
                    self._closed(key)
            if time.monotonic() >= next_byte:
                next_byte += self.every
                for key in list(self.sel.get_map().values()):
                    sent = key.data[1]
                    try:
                        key.fileobj.send(self.HEAD[sent : sent + 1])
                        key.data[1] = sent + 1
                    except OSError:  # reset or broken pipe: closed by the server
                        self._closed(key)
            if self.stop.is_set():
                if not self.sel.get_map():
                    return
            else:
                for _ in range(self.n - len(self.sel.get_map())):
                    self._open()

    def oldest(self) -> float:
        now = time.monotonic()
        return max((now - key.data[0] for key in self.sel.get_map().values()), default=0.0)


def test_trickled_headers_are_cut_off_while_training_goes_on(srv: ServerProcess):
    trickler = Trickler(srv, n=200, every=0.3)
    trickler.thread.start()
    try:
        deadline = time.monotonic() + 30
        while len(trickler.lifetimes) < 200:  # a first round of slow connections was cut off
            assert time.monotonic() < deadline and trickler.error is None, (trickler.error, len(trickler.lifetimes))
            time.sleep(0.05)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(list(range(10, 18))),
            loss_fn_inputs={"target_tokens": list(range(11, 19)), "weights": [1.0] * 8},
        )
        with tinker.ServiceClient(base_url=srv.base_url) as service:
            tc = service.create_lora_training_client(base_model=ALIAS, rank=8).result()
            for step in range(3):
                assert tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
                assert (
                    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["optimizer_step"] == step + 1
                )
                start = time.monotonic()
                assert httpx.get(f"{srv.base_url}/healthz", timeout=10).status_code == 200
                assert time.monotonic() - start < 2.0
                assert trickler.oldest() < HEADER_TIMEOUT + MARGIN
    finally:
        trickler.stop.set()
        trickler.thread.join(timeout=HEADER_TIMEOUT + MARGIN + 5)
    assert trickler.error is None, trickler.error
    assert not trickler.thread.is_alive(), "some trickling connections were never closed"
    assert max(trickler.lifetimes) < HEADER_TIMEOUT + MARGIN
    assert min(trickler.lifetimes) > HEADER_TIMEOUT * 0.8
    assert all(a == b"" or a.startswith(b"HTTP/1.1 408 ") for a in trickler.answers)
    assert any(b"connection: close" in a and b'"detail"' in a for a in trickler.answers)


def test_headers_past_the_bound_get_431(srv: ServerProcess):
    padding = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(100))  # 100 KiB
    with connect(srv) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: big\r\n" + padding + b"\r\n")
        answer = read_until_closed(sock, 10)
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), answer[:200]
    assert b"connection: close" in answer and answer.endswith(b'exceed 65536 bytes"}')
    with connect(srv) as sock:  # one header that never ends: cut off once past the bound
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: big\r\nX-Long: " + b"l" * (70 << 10))
        answer = read_until_closed(sock, 10)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert httpx.get(f"{srv.base_url}/healthz", timeout=10).status_code == 200


def slow_post(srv: ServerProcess, length: int, paced: bytes = b"", pace: float = 0.0) -> tuple[bytes, float]:
    """A POST of ``length`` bytes to a keyed route that sends 10 of them with its headers, then
    ``paced`` one 100-byte piece per ``pace`` seconds, then stalls (if any are left); the server's
    answer and how long after the headers it came."""
    with connect(srv) as sock:
        sock.sendall(
            b"POST /api/v1/forward_backward HTTP/1.1\r\nHost: slow\r\nConnection: close\r\n"
            b"Content-Type: application/x-protobuf\r\nContent-Length: %d\r\n\r\n0123456789" % length
        )
        start = time.monotonic()
        for i in range(0, len(paced), 100):
            time.sleep(pace)  # the pace of the upload itself
            sock.sendall(paced[i : i + 100])
        answer = read_until_closed(sock, BODY_TIMEOUT + length / MIN_BODY_RATE + MARGIN + 5)
        return answer, time.monotonic() - start


def test_a_stalled_body_gets_408(srv: ServerProcess):
    answer, took = slow_post(srv, 10000)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer[:200]
    assert b"connection: close" in answer and b'{"detail": "request body not received within' in answer
    assert BODY_TIMEOUT * 0.8 < took < BODY_TIMEOUT + MARGIN
    assert httpx.get(f"{srv.base_url}/healthz", timeout=10).status_code == 200


def test_a_body_above_the_minimum_rate_may_take_longer_than_the_body_timeout(srv: ServerProcess):
    # 2000 bytes/s, twice the minimum rate, for 1.2 s: the deadline keeps ahead of the upload,
    # and the route answers the (not protobuf) body itself.
    answer, took = slow_post(srv, 10 + 2400, b"x" * 2400, pace=0.05)
    assert took > BODY_TIMEOUT * 1.1
    assert answer.startswith(b"HTTP/1.1 4") and not answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_kept_alive_and_pipelined_clients_are_unaffected(srv: ServerProcess):
    with httpx.Client(base_url=srv.base_url, headers={"X-API-Key": "tml-test"}, timeout=10) as client:
        ports = set()
        for i in range(3):
            if i:
                time.sleep(HEADER_TIMEOUT * 1.5)  # idle, under the keep-alive: not the header timeout
            r = client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"})
            assert r.status_code == 200, r.text
            assert client.get("/healthz").status_code == 200
            ports.add(r.extensions["network_stream"].get_extra_info("client_addr"))
        assert len(ports) == 1  # one connection throughout
    with connect(srv) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: p\r\n\r\n" * 2
            + b"GET /healthz HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n"
        )
        answer = read_until_closed(sock, 10)
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 3, answer[:500]


def test_bytes_that_begin_no_request_do_not_hold_a_kept_alive_connection(srv: ServerProcess):
    # Bare CRLFs between requests begin none, yet each one cancels uvicorn's keep-alive timer.
    with connect(srv) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: idle\r\n\r\n")
        answer = b""
        while b"}" not in answer:
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        start = time.monotonic()
        sock.setblocking(False)
        closed = False
        while not closed:
            assert time.monotonic() - start < HEADER_TIMEOUT + MARGIN, "the connection was kept open"
            try:
                sock.send(b"\r\n")
                time.sleep(0.3)  # the trickle itself
                closed = sock.recv(65536) == b""  # nothing is answered: the connection is closed quietly
            except BlockingIOError:
                pass
            except OSError:
                closed = True
    assert time.monotonic() - start > HEADER_TIMEOUT * 0.8
