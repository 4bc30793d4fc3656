"""Validation (issue #6, item 3): a table of malformed requests, sent as raw HTTP and through the
real SDK where it lets the bad value through. Every one must be answered at once with a 4xx whose
JSON body names the offending field; none may crash, hang or stall the server. Afterwards a
normal SFT step still works and /healthz is green.

One server is shared by every case (``--max-seq-len 64``, so over-long sequences are cheap), but
each test gets a session and raw model of its own, with its own seq numbering, so any test can run
alone or in any order. Ordered requests (those with a ``seq_id``) that the server rejects still
consume their seq_id; each test's world tracks that, and after every case a valid request proves
neither model was left waiting on a gap (nor had a seq_id consumed that the world did not count).
"""

from __future__ import annotations

import http.client
import json
import math
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from tests.support.server import ALIAS, ServerProcess, start_server

# The tests that use the server are marked slow one by one; the two that do not are fast.
pytestmark = pytest.mark.timeout(120)

HEADERS = {"X-API-Key": "tml-test"}
PROTOBUF = {"Content-Type": "application/x-protobuf"}
JSON = {"Content-Type": "application/json"}
MAX_SEQ_LEN = 64


# ---- the server and what the cases act on ----------------------------------------------------


@dataclass
class Reply:
    status: int
    body: Any


@dataclass
class World:
    """Ids the cases act on; ``seq`` is the raw model's next unused seq_id. The server, the
    checkpoints, the sampler and the SDK clients are shared by every test; the session, the raw
    model and its ``seq`` are each test's own (the ``world`` fixture)."""

    server: ServerProcess
    http: httpx.Client
    session_id: str
    model_id: str
    sampler_id: str
    weights_path: str  # checkpoints named "good", of the model ``good_run``
    sampler_path: str
    vocab: int
    body_limit: int
    seq: int
    good_run: str = ""
    sdk: dict[str, Any] = field(default_factory=dict)

    def next_seq(self) -> int:
        """A seq_id the server will consume (the request reaches the model's queue)."""
        self.seq += 1
        return self.seq - 1

    def post(self, path: str, json_body: Any = ..., **kw) -> Reply:
        if json_body is not ...:  # httpx refuses NaN and Infinity; a client may still send them
            kw["content"] = json.dumps(json_body).encode()
            kw["headers"] = {"Content-Type": "application/json", **kw.get("headers", {})}
        return _reply(self.http.post(path, **kw))

    def result(self, request_id: str, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            assert time.monotonic() < deadline, f"{request_id} did not finish in {timeout}s"
            r = self.http.post("/api/v1/retrieve_future", json={"request_id": request_id})
            assert r.status_code == 200, r.text
            if r.headers["content-type"].startswith("application/x-protobuf"):
                return deserialize_forward_backward_output(r.content)
            body = r.json()
            if body.get("type") != "try_again":
                assert "error" not in body, body
                return body


def _reply(r: httpx.Response) -> Reply:
    try:
        return Reply(r.status_code, r.json())
    except ValueError:
        return Reply(r.status_code, r.text)


def _new_session_and_model(w: World) -> World:
    """``w`` with a new session holding a new raw model, whose next seq_id is 1 (0 created it)."""
    session = w.http.post("/api/v1/create_session", json={"tags": ["bad-input"]}).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": ALIAS, "lora_config": {"rank": 4, "seed": 0}}
    model_id = w.result(w.http.post("/api/v1/create_model", json=body).json()["request_id"])["model_id"]
    return replace(w, session_id=session, model_id=model_id, seq=1)


def strict_chat_template(model: Path, to: Path) -> Path:
    """The tiny model with a chat template that, as Qwen3-2507's, refuses a conversation
    without a user message (its own ``raise_exception``)."""
    shutil.copytree(model, to)
    config = json.loads((to / "tokenizer_config.json").read_text())
    guard = "{%- if not (messages | selectattr('role', 'equalto', 'user') | list) %}"
    refusal = "{{ raise_exception('No user query found in messages.') }}{%- endif %}"
    config["chat_template"] = guard + refusal + config["chat_template"]
    (to / "tokenizer_config.json").write_text(json.dumps(config))
    return to


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[World]:
    """The server and what every test may share: checkpoints, a sampler, the SDK clients."""
    data_dir = tmp_path_factory.mktemp("bad-input")
    model = strict_chat_template(tiny_model_dir, data_dir / "model")
    server = start_server(data_dir, "--model", str(model), "--max-seq-len", str(MAX_SEQ_LEN))
    http = httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60)
    try:
        caps = http.get("/healthz").json()["capabilities"]
        assert caps["max_seq_len"] == MAX_SEQ_LEN
        w = World(server, http, "", "", "", "", "", caps["vocab_size"], 256 << 20, seq=1)
        w = _new_session_and_model(w)  # the checkpoints' model: its seq_ids are this fixture's
        session, w.good_run = w.session_id, w.model_id
        saved = w.post(
            "/api/v1/save_weights", json_body={"model_id": w.model_id, "seq_id": w.next_seq(), "path": "good"}
        )
        w.weights_path = w.result(saved.body["request_id"])["path"]
        saved = w.post(
            "/api/v1/save_weights_for_sampler",
            json_body={"model_id": w.model_id, "seq_id": w.next_seq(), "path": "good"},
        )
        w.sampler_path = w.result(saved.body["request_id"])["path"]
        body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": ALIAS}
        w.sampler_id = http.post("/api/v1/create_sampling_session", json=body).json()["sampling_session_id"]
        with tinker.ServiceClient(base_url=server.base_url) as sc:
            tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=0).result()
            w.sdk = {
                "sc": sc,
                "tc": tc,
                "sampler": sc.create_sampling_client(base_model=ALIAS).result(),
                "rest": tinker.RestClient(base_url=server.base_url),
            }
            yield w
    finally:
        http.close()
        server.stop()


@pytest.fixture
def world(shared: World) -> World:
    """The shared world, with a session and raw model of this test's own: its seq_ids start at 1."""
    return _new_session_and_model(shared)


def assert_no_gap(w: World) -> None:
    """Neither model waits on a seq_id that a rejected request did not consume, and none was
    consumed that the world did not count: a valid request on each runs at once."""
    req = _fb_request(w.model_id, w.next_seq())
    sent = w.post("/api/v1/forward_backward", content=req.SerializeToString(), headers=PROTOBUF)
    assert sent.status == 200, sent.body
    assert w.result(sent.body["request_id"], timeout=30).metrics["loss:sum"] > 0
    w.sdk["tc"].forward([_datum([5, 6, 7])], "cross_entropy").result(timeout=30)


# ---- request builders -------------------------------------------------------------------------


def _tensor(values: Any, dtype: str, pb_dtype: int, shape: list[int] | None = None) -> pb.Tensor:
    arr = np.asarray(values, dtype=dtype)
    return pb.Tensor(dense=arr.tobytes(), dtype=pb_dtype, shape=list(arr.shape) if shape is None else shape)


def _ints(values: Any, shape: list[int] | None = None) -> pb.Tensor:
    return _tensor(values, "<i8", pb.DTYPE_INT64, shape)


def _floats(values: Any, shape: list[int] | None = None) -> pb.Tensor:
    return _tensor(values, "<f4", pb.DTYPE_FLOAT32, shape)


# Valid per-position values of each loss input, for a datum of n positions.
_INPUTS: dict[str, Callable[[int], pb.Tensor]] = {
    "target_tokens": lambda n: _ints(np.arange(10, 10 + n)),
    "weights": lambda n: _floats(np.ones(n)),
    "logprobs": lambda n: _floats(np.full(n, -1.0)),
    "advantages": lambda n: _floats(np.ones(n)),
}
_LOSS_INPUTS = {"cross_entropy": ("target_tokens", "weights")}
_PG_INPUTS = ("target_tokens", "logprobs", "advantages")


def _fb_request(model_id: str, seq_id: int, loss_fn: str = "cross_entropy", n: int = 8) -> pb.ForwardBackwardRequest:
    """A valid request of one datum of ``n`` positions; cases then spoil one thing."""
    req = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn)
    d = req.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(9, 9 + n, dtype="<i4").tobytes()
    for key in _LOSS_INPUTS.get(loss_fn, _PG_INPUTS):
        d.loss_fn_inputs[key].CopyFrom(_INPUTS[key](n))
    return req


def _set_tokens(req: pb.ForwardBackwardRequest, tokens: Any) -> None:
    req.data[0].model_input[0].encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes()


def fb(mutate: Callable[[pb.ForwardBackwardRequest], None], loss_fn: str = "cross_entropy") -> Callable[[World], Reply]:
    """A forward_backward that decodes and reaches the model's queue (so consumes its seq_id)."""

    def send(w: World) -> Reply:
        req = _fb_request(w.model_id, w.next_seq(), loss_fn)
        mutate(req)
        return w.post("/api/v1/forward_backward", content=req.SerializeToString(), headers=PROTOBUF)

    return send


def fb_raw(make_body: Callable[[bytes], bytes], headers: dict[str, str] | None = None) -> Callable[[World], Reply]:
    """A forward_backward refused before it is decoded: its seq_id stays unused."""

    def send(w: World) -> Reply:
        body = make_body(_fb_request(w.model_id, w.seq).SerializeToString())
        return w.post("/api/v1/forward_backward", content=body, headers={**PROTOBUF, **(headers or {})})

    return send


def _unknown_loss_id(req: pb.ForwardBackwardRequest) -> None:
    req.loss_fn_config_v2["loss_id"].text = "loss-nope"


def set_input(key: str, tensor: pb.Tensor) -> Callable[[pb.ForwardBackwardRequest], None]:
    def mutate(req: pb.ForwardBackwardRequest) -> None:
        req.data[0].loss_fn_inputs[key].CopyFrom(tensor)

    return mutate


def optim(adam: dict | None = None, consumes: bool = True, **top: Any) -> Callable[[World], Reply]:
    def send(w: World) -> Reply:
        body = {"model_id": w.model_id, "seq_id": w.next_seq() if consumes else w.seq, **top}
        if adam is not None:
            body["adam_params"] = adam
        return w.post("/api/v1/optim_step", json_body={k: v for k, v in body.items() if v is not ...})

    return send


def sample(params: dict | None = None, tokens: Any = (5, 6, 7), **top: Any) -> Callable[[World], Reply]:
    def send(w: World) -> Reply:
        body = {
            "sampling_session_id": w.sampler_id,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(tokens)}]},
            "sampling_params": {"max_tokens": 4, **(params or {})},
            "num_samples": 1,
            **top,
        }
        return w.post("/api/v1/asample", json_body={k: v for k, v in body.items() if v is not ...})

    return send


def post(path: str, body: Callable[[World], Any]) -> Callable[[World], Reply]:
    return lambda w: w.post(f"/api/v1/{path}", json_body=body(w))


def post_raw(path: str, content: bytes, headers: dict[str, str]) -> Callable[[World], Reply]:
    return lambda w: w.post(f"/api/v1/{path}", content=content, headers=headers)


def rest(method: str, path: Callable[[World], str], body: Any = None) -> Callable[[World], Reply]:
    return lambda w: _reply(w.http.request(method, f"/api/v1/{path(w)}", json=body))


def openai(path: str, **body: Any) -> Callable[[World], Reply]:
    base = {"model": ALIAS, "max_tokens": 4}
    if path == "chat/completions":
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    return lambda w: w.post(f"/v1/{path}", json_body={k: v for k, v in {**base, **body}.items() if v is not ...})


def declared_oversize(path: str, content_type: str, size: int | None = None) -> Callable[[World], Reply]:
    """Headers that announce a body over the limit (``size`` bytes; default: one over the large
    limit), and only its first bytes: the server must answer 413 rather than wait for (and
    buffer) the rest. (An ordered route waits a moment, ``body_limit.HEAD_WAIT_S``, for a head
    that names its seq_id; this one never comes.)"""

    def send(w: World) -> Reply:
        url = urlsplit(w.server.base_url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        try:
            conn.putrequest("POST", f"/api/v1/{path}")
            length = size if size is not None else w.body_limit + 1
            for k, v in {**HEADERS, "Content-Type": content_type, "Content-Length": str(length)}.items():
                conn.putheader(k, v)
            conn.endheaders(b"{" if "json" in content_type else b"\n\x00")
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            return Reply(resp.status, json.loads(raw))
        except ValueError:
            return Reply(resp.status, raw.decode(errors="replace"))

    return send


def _zstd_bomb(_: bytes) -> bytes:
    # ~10 KiB that inflates to 300 MiB, past the 256 MiB body limit: one field (model_id) whose
    # start the walk as it inflates finds nothing wrong with.
    length = bytearray()
    value = 300 << 20
    while value >= 0x80:
        length.append(value & 0x7F | 0x80)
        value >>= 7
    return zstandard.ZstdCompressor(level=19).compress(b"\x0a" + bytes(length + bytes([value])) + b"\0" * (300 << 20))


def _zstd_field_bomb(_: bytes) -> bytes:
    # the same size of zero bytes: 150 M empty fields, refused as the walk of its start counts them
    return zstandard.ZstdCompressor(level=19).compress(b"\0" * (300 << 20))


def _nan_config(req: pb.ForwardBackwardRequest) -> None:
    req.loss_fn_config["clip_low_threshold"] = math.nan


def _inf_config_v2(req: pb.ForwardBackwardRequest) -> None:
    req.loss_fn_config_v2["clip_high_threshold"].number = math.inf


def _over_token_budget(req: pb.ForwardBackwardRequest) -> None:
    # 16385 datums of 64 tokens: 2**20 + 64 tokens, just over the per-request budget of 2**20.
    tokens = np.arange(1, MAX_SEQ_LEN + 1, dtype="<i4").tobytes()
    del req.data[:]
    for _ in range((1 << 20) // MAX_SEQ_LEN + 1):
        req.data.add().model_input.add().encoded_text.tokens = tokens


def _bad_csr(req: pb.ForwardBackwardRequest) -> None:
    t = req.data[0].loss_fn_inputs["target_tokens"]
    t.Clear()
    t.dtype, t.shape[:] = pb.DTYPE_INT64, [8, 2]
    t.sparse_csr.values = np.array([5, 6], "<i8").tobytes()
    t.sparse_csr.crow_indices = np.array([0, 2, 1, 2, 2, 2, 2, 2, 2], "<i8").tobytes()  # decreasing
    t.sparse_csr.col_indices = np.array([0, 1], "<i8").tobytes()


def _image_chunk(req: pb.ForwardBackwardRequest) -> None:
    req.data[0].model_input.add().image.data = b"\x89PNG"


# ---- the table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    send: Callable[[World], Reply]
    status: int
    field: str  # must appear in the error body's message (or in a 422's location)


N = 8  # positions of the datum fb() builds
CASES: list[Case] = [
    # forward_backward: tensor dtypes
    Case("fb target_tokens float32", fb(set_input("target_tokens", _floats(np.arange(N)))), 400, "target_tokens"),
    Case("fb weights int64", fb(set_input("weights", _ints(np.ones(N)))), 400, "weights"),
    Case(
        "fb weights dtype bfloat16",
        fb(set_input("weights", pb.Tensor(dense=b"\0" * 2 * N, dtype=pb.DTYPE_BFLOAT16, shape=[N]))),
        400,
        "loss_fn_inputs.weights",
    ),
    Case(
        "fb weights dtype unknown enum 77",
        fb(set_input("weights", pb.Tensor(dense=b"\0" * 4 * N, dtype=77, shape=[N]))),
        400,
        "loss_fn_inputs.weights",
    ),
    # forward_backward: shapes and lengths
    Case("fb weights 2-D", fb(set_input("weights", _floats(np.ones((N, 1))))), 400, "weights"),
    Case("fb target_tokens 3-D", fb(set_input("target_tokens", _ints(np.ones((N, 1, 1))))), 400, "target_tokens"),
    Case(
        "fb target shape does not match its data",
        fb(set_input("target_tokens", _ints(np.arange(N), shape=[N + 1]))),
        400,
        "target_tokens",
    ),
    Case("fb negative shape dim", fb(set_input("weights", _floats([], shape=[-1]))), 400, "weights"),
    Case("fb target_tokens shorter", fb(set_input("target_tokens", _ints(np.arange(N - 1)))), 400, "target_tokens"),
    Case("fb weights longer", fb(set_input("weights", _floats(np.ones(N + 1)))), 400, "weights"),
    Case(
        "fb logprobs shorter (importance_sampling)",
        fb(set_input("logprobs", _floats(np.zeros(N - 2))), "importance_sampling"),
        400,
        "logprobs",
    ),
    Case("fb advantages longer (ppo)", fb(set_input("advantages", _floats(np.ones(N + 3))), "ppo"), 400, "advantages"),
    Case(
        "fb 2-D targets for a policy loss",
        fb(set_input("target_tokens", _ints(np.ones((N, 2)))), "importance_sampling"),
        400,
        "target_tokens",
    ),
    Case("fb inconsistent CSR target_tokens", fb(_bad_csr), 400, "target_tokens"),
    Case(
        "fb token bytes not whole int32s",
        fb(lambda r: setattr(r.data[0].model_input[0].encoded_text, "tokens", b"\1\0\0\0\2")),
        400,
        "model_input[0].tokens",
    ),
    # forward_backward: token ids outside the vocabulary
    Case("fb model_input negative id", fb(lambda r: _set_tokens(r, [-1] + [5] * (N - 1))), 400, "model_input"),
    Case("fb model_input id >= vocab", fb(lambda r: _set_tokens(r, [5] * (N - 1) + [512])), 400, "model_input"),
    Case("fb target_tokens negative id", fb(set_input("target_tokens", _ints([-7] * N))), 400, "target_tokens"),
    Case("fb target_tokens id >= vocab", fb(set_input("target_tokens", _ints([10**9] * N))), 400, "target_tokens"),
    # forward_backward: non-finite values
    Case("fb NaN weight", fb(set_input("weights", _floats([1.0] * (N - 1) + [math.nan]))), 400, "weights"),
    Case("fb +inf weight", fb(set_input("weights", _floats([math.inf] + [1.0] * (N - 1)))), 400, "weights"),
    Case(
        "fb -inf advantage",
        fb(set_input("advantages", _floats([-math.inf] * N)), "importance_sampling"),
        400,
        "advantages",
    ),
    Case("fb NaN loss_fn_config", fb(_nan_config, "ppo"), 400, "loss_fn_config.clip_low_threshold"),
    Case("fb custom without loss_id", fb(lambda r: None, "custom"), 400, "loss_id"),
    Case(
        "fb custom unknown loss_id",
        fb(_unknown_loss_id, "custom"),
        404,
        "loss_id",
    ),
    Case(
        "create_custom_loss forbidden call",
        post(
            "create_custom_loss",
            lambda w: {
                "session_id": w.session_id,
                "custom_loss_seq_id": 1,
                "name": "evil",
                "inputs": [{"name": "logprobs", "rank": 1}],
                "graph": {
                    "nodes": [
                        {"op": "placeholder", "name": "logprobs", "target": "logprobs"},
                        {"op": "call_function", "name": "x", "target": "builtins.exec", "args": ["1"]},
                        {"op": "output", "name": "output", "target": "output", "args": [{"ref": "x"}]},
                    ]
                },
            },
        ),
        400,
        "'builtins.exec' is not allowed",
    ),
    Case(
        "create_custom_loss input rank 3",
        post(
            "create_custom_loss",
            lambda w: {
                "session_id": w.session_id,
                "custom_loss_seq_id": 2,
                "name": "x",
                "inputs": [{"name": "logprobs", "rank": 3}],
                "graph": {"nodes": []},
            },
        ),
        422,
        "rank",
    ),
    Case("fb +inf loss_fn_config_v2", fb(_inf_config_v2, "cispo"), 400, "loss_fn_config.clip_high_threshold"),
    # forward_backward: empty and oversized batches
    Case("fb empty batch", fb(lambda r: r.ClearField("data")), 400, "data"),
    Case("fb datum without model_input", fb(lambda r: r.data[0].ClearField("model_input")), 400, "model_input"),
    Case("fb model_input of zero tokens", fb(lambda r: _set_tokens(r, [])), 400, "model_input"),
    Case("fb sequence over --max-seq-len", fb(lambda r: _set_tokens(r, [5] * (MAX_SEQ_LEN + 1))), 400, "model_input"),
    Case("fb batch over the token budget", fb(_over_token_budget), 400, "data"),
    Case("fb image chunk", fb(_image_chunk), 400, "model_input[1]"),
    # forward_backward: losses and their inputs
    Case("fb unknown loss_fn", fb(lambda r: setattr(r, "loss_fn", "cross_entropyy")), 400, "loss_fn"),
    Case(
        "fb unknown loss_fn_config key",
        fb(lambda r: r.loss_fn_config.__setitem__("temperature", 1.0)),
        400,
        "loss_fn_config.temperature",
    ),
    Case("fb unknown loss_fn_inputs key", fb(set_input("mask", _floats(np.ones(N)))), 400, "loss_fn_inputs.mask"),
    Case(
        "fb missing target_tokens",
        fb(lambda r: r.data[0].loss_fn_inputs.pop("target_tokens")),
        400,
        "target_tokens",
    ),
    # (cross_entropy without weights counts every position once, as the SDK's own examples send it)
    Case(
        "fb missing logprobs (importance_sampling)",
        fb(lambda r: r.data[0].loss_fn_inputs.pop("logprobs"), "importance_sampling"),
        400,
        "logprobs",
    ),
    Case(
        "fb missing advantages (ppo)",
        fb(lambda r: r.data[0].loss_fn_inputs.pop("advantages"), "ppo"),
        400,
        "advantages",
    ),
    # forward_backward: ids and envelopes
    Case("fb seq_id 0", fb_raw(lambda b: _with_seq(b, 0)), 400, "seq_id"),
    Case("fb seq_id negative", fb_raw(lambda b: _with_seq(b, -4)), 400, "seq_id"),
    Case("fb unknown model_id", fb_raw(lambda b: _with_model(b, "sess-nope:train:0")), 404, "model_id"),
    Case("fb not a protobuf", fb_raw(lambda b: b"\xff\xff\xff\xff not a protobuf"), 400, "ForwardBackwardRequest"),
    Case("fb JSON content type", fb_raw(lambda b: b, {"Content-Type": "application/json"}), 415, "Content-Type"),
    Case("fb gzip Content-Encoding", fb_raw(lambda b: b, {"Content-Encoding": "gzip"}), 415, "Content-Encoding"),
    Case(
        "fb corrupt zstd",
        fb_raw(lambda b: b"\x28\xb5\x2f\xfd" + b"garbage" * 8, {"Content-Encoding": "zstd"}),
        400,
        "zstd",
    ),
    Case(
        "fb truncated zstd",
        fb_raw(lambda b: zstandard.ZstdCompressor().compress(b)[:-3], {"Content-Encoding": "zstd"}),
        400,
        "zstd",
    ),
    Case("fb zstd bomb", fb_raw(_zstd_bomb, {"Content-Encoding": "zstd"}), 400, "exceeds"),
    Case("fb zstd bomb of fields", fb_raw(_zstd_field_bomb, {"Content-Encoding": "zstd"}), 400, "protobuf fields"),
    Case("fb body over the limit", declared_oversize("forward_backward", "application/x-protobuf"), 413, "body"),
    # optim_step
    Case("optim negative learning_rate", optim({"learning_rate": -1e-3}), 400, "adam_params.learning_rate"),
    Case("optim beta1 = 1", optim({"beta1": 1.0}), 400, "adam_params.beta1"),
    Case("optim beta2 > 1", optim({"beta2": 1.5}), 400, "adam_params.beta2"),
    Case("optim eps = 0", optim({"eps": 0.0}), 400, "adam_params.eps"),
    Case("optim eps < 0", optim({"eps": -1e-8}), 400, "adam_params.eps"),
    Case("optim NaN learning_rate", optim({"learning_rate": math.nan}), 400, "adam_params.learning_rate"),
    Case("optim +inf grad_clip_norm", optim({"grad_clip_norm": math.inf}), 400, "adam_params.grad_clip_norm"),
    Case("optim negative weight_decay", optim({"weight_decay": -0.1}), 400, "adam_params.weight_decay"),
    Case("optim unknown optimizer_params", optim(None, optimizer_params={"type": "muon"}), 400, "optimizer_params"),
    Case(
        "optim Dimuon params on an AdamW model",
        optim(None, optimizer_params={"type": "dimuon", "learning_rate": 0.1}),
        400,
        "created with the adamw optimizer",
    ),
    Case(
        "optim adam_params and optimizer_params",
        optim({}, optimizer_params={"type": "dimuon", "learning_rate": 0.1}),
        400,
        "not both",
    ),
    Case("optim optimizer_params a list", optim(None, optimizer_params=[0.1]), 422, "optimizer_params"),
    Case("optim seq_id 0", optim({}, consumes=False, seq_id=0), 400, "seq_id"),
    Case("optim seq_id negative", optim({}, consumes=False, seq_id=-3), 400, "seq_id"),
    Case("optim seq_id over int32", optim({}, consumes=False, seq_id=2**31), 400, "seq_id"),
    Case("optim seq_id over int64", optim({}, consumes=False, seq_id=2**70), 400, "seq_id"),
    Case("optim seq_id fractional", optim({}, consumes=False, seq_id=1.5), 422, "seq_id"),
    Case("optim seq_id a string", optim({}, consumes=False, seq_id="one"), 422, "seq_id"),
    Case("optim missing seq_id", optim({}, consumes=False, seq_id=...), 422, "seq_id"),
    # A 422 naming a valid model and seq_id still consumes the seq_id (the last test checks).
    Case("optim unknown adam key", optim({"lr": 1e-3}), 422, "adam_params.lr"),
    Case("optim unknown top-level key", optim({}, momentum=0.9), 422, "momentum"),
    Case("optim adam_params a list", optim([1e-3]), 422, "adam_params"),  # type: ignore[arg-type]
    Case("optim null learning_rate", optim({"learning_rate": None}), 422, "adam_params.learning_rate"),
    Case(
        "save_weights ttl_seconds a string",
        post(
            "save_weights", lambda w: {"model_id": w.model_id, "seq_id": w.next_seq(), "path": "s", "ttl_seconds": "1h"}
        ),
        422,
        "ttl_seconds",
    ),
    Case(
        "optim unknown model_id", post("optim_step", lambda w: {"model_id": "x:train:0", "seq_id": 1}), 404, "model_id"
    ),
    Case(
        "optim invalid JSON",
        post_raw("optim_step", b'{"model_id": "m", "seq_id": 1,', {"Content-Type": "application/json"}),
        422,
        "body",
    ),
    Case(
        "optim JSON array body",
        post_raw("optim_step", b"[1, 2]", {"Content-Type": "application/json"}),
        422,
        "body",
    ),
    Case("JSON body over the limit", declared_oversize("asample", "application/json"), 413, "body"),
    Case(
        "sample body over the prompt limit",
        declared_oversize("asample", "application/json", size=(32 << 20) + 1),
        413,
        "--max-prompt-body-bytes",
    ),
    Case(
        "JSON route gzip Content-Encoding",
        post_raw("optim_step", b"\x1f\x8b\x08\x00", {"Content-Type": "application/json", "Content-Encoding": "gzip"}),
        415,
        "Content-Encoding",
    ),
    # asample
    Case("sample negative prompt token", sample(tokens=[5, -1]), 400, "prompt"),
    Case("sample prompt token >= vocab", sample(tokens=[5, 512]), 400, "prompt"),
    Case("sample prompt token over int64", sample(tokens=[2**70]), 400, "prompt"),
    Case("sample stop token id >= vocab", sample({"stop": [2, 99999]}), 400, "sampling_params.stop"),
    Case("sample stop token id negative", sample({"stop": [-2]}), 400, "sampling_params.stop"),
    Case("sample empty stop string", sample({"stop": ["\n", ""]}), 400, "sampling_params.stop"),
    Case("sample 17 stop strings", sample({"stop": [f"<{i}>" for i in range(17)]}), 400, "sampling_params.stop"),
    Case("sample stop string of 129 characters", sample({"stop": ["x" * 129]}), 400, "sampling_params.stop"),
    Case("sample seq_id over int64", sample(seq_id=2**63), 422, "seq_id"),
    Case("sample negative seq_id", sample(seq_id=-1), 422, "seq_id"),
    Case("sample negative max_tokens", sample({"max_tokens": -1}), 400, "max_tokens"),
    Case("sample huge max_tokens", sample({"max_tokens": 10**9}), 400, "max_tokens"),
    Case("sample num_samples 0", sample(num_samples=0), 400, "num_samples"),
    Case("sample num_samples a billion", sample(num_samples=10**9), 400, "num_samples"),
    Case("sample negative temperature", sample({"temperature": -0.5}), 400, "temperature"),
    Case("sample NaN temperature", sample({"temperature": math.nan}), 400, "temperature"),
    Case("sample top_p 0", sample({"top_p": 0.0}), 400, "top_p"),
    Case("sample top_p 1.5", sample({"top_p": 1.5}), 400, "top_p"),
    Case("sample top_k 0", sample({"top_k": 0}), 400, "top_k"),
    Case("sample top_k -5", sample({"top_k": -5}), 400, "top_k"),
    Case("sample seed over 64 bits", sample({"seed": 2**64}), 400, "seed"),
    Case("sample empty prompt", sample(tokens=[]), 400, "prompt"),
    Case("sample prompt over --max-seq-len", sample(tokens=[5] * (MAX_SEQ_LEN + 1)), 400, "prompt"),
    Case(
        "sample image chunk",
        sample(prompt={"chunks": [{"type": "image", "data": "", "format": "png"}]}),
        400,
        "prompt.chunks[0]",
    ),
    Case(
        "sample tokens of the wrong type",
        sample(prompt={"chunks": [{"type": "encoded_text", "tokens": ["a", "b"]}]}),
        400,
        "prompt.chunks[0].tokens",
    ),
    Case(
        "sample unknown chunk key",
        sample(prompt={"chunks": [{"type": "encoded_text", "tokens": [1], "weights": [1]}]}),
        400,
        "prompt.chunks[0].weights",
    ),
    Case("sample unknown sampling_params key", sample({"beam_width": 4}), 422, "sampling_params.beam_width"),
    Case("sample num_samples a string", sample(num_samples="many"), 422, "num_samples"),
    Case("sample missing prompt", sample(prompt=...), 422, "prompt"),
    Case(
        "sample topk_prompt_logprobs 1000",
        sample(prompt_logprobs=True, topk_prompt_logprobs=1000),
        400,
        "topk_prompt_logprobs",
    ),
    Case(
        "sample unknown sampling_session_id", sample(sampling_session_id="sess-x:sample:0"), 404, "sampling_session_id"
    ),
    # tinker:// paths
    Case(
        "load_weights s3:// path",
        post(
            "load_weights",
            lambda w: {"model_id": w.model_id, "seq_id": w.next_seq(), "path": "s3://b/k", "optimizer": False},
        ),
        400,
        "path",
    ),
    Case(
        "load_weights sampler_weights kind",
        post(
            "load_weights",
            lambda w: {"model_id": w.model_id, "seq_id": w.next_seq(), "path": w.sampler_path, "optimizer": True},
        ),
        400,
        "path",
    ),
    Case(
        "load_weights '..' in the name",
        post(
            "load_weights",
            lambda w: {
                "model_id": w.model_id,
                "seq_id": w.next_seq(),
                "path": f"tinker://{w.model_id}/weights/..",
                "optimizer": False,
            },
        ),
        400,
        "path",
    ),
    Case(
        "load_weights unknown run",
        post(
            "load_weights",
            lambda w: {
                "session_id": w.session_id,
                "model_seq_id": 7,
                "path": "tinker://sess-none:train:0/weights/a",
                "optimizer": False,
            },
        ),
        404,
        "path",
    ),
    Case(
        "load_weights empty name",
        post(
            "load_weights",
            lambda w: {
                "session_id": w.session_id,
                "model_seq_id": 8,
                "path": f"tinker://{w.model_id}/weights/",
                "optimizer": False,
            },
        ),
        400,
        "path",
    ),
    Case(
        "load_weights unsupported access token",
        post(
            "load_weights",
            lambda w: {
                "model_id": w.model_id,
                "seq_id": w.next_seq(),
                "path": w.weights_path,
                "optimizer": False,
                "weights_access_token": "t",
            },
        ),
        400,
        "weights_access_token",
    ),
    Case(
        "sampling session run id '..'",
        post(
            "create_sampling_session",
            lambda w: {
                "session_id": w.session_id,
                "sampling_session_seq_id": 5,
                "model_path": "tinker://../sampler_weights/good",
            },
        ),
        400,
        "model_path",
    ),
    Case(
        "sampling session http:// path",
        post(
            "create_sampling_session",
            lambda w: {
                "session_id": w.session_id,
                "sampling_session_seq_id": 6,
                "model_path": "http://x/sampler_weights/a",
            },
        ),
        400,
        "model_path",
    ),
    Case(
        "sampling session unknown kind",
        post(
            "create_sampling_session",
            lambda w: {
                "session_id": w.session_id,
                "sampling_session_seq_id": 7,
                "model_path": f"tinker://{w.good_run}/adapters/good",
            },
        ),
        400,
        "model_path",
    ),
    Case(
        "sampling session unknown run",
        post(
            "create_sampling_session",
            lambda w: {
                "session_id": w.session_id,
                "sampling_session_seq_id": 8,
                "model_path": "tinker://sess-none:train:0/sampler_weights/a",
            },
        ),
        404,
        "model_path",
    ),
    Case(
        "sampling session unknown base_model",
        post(
            "create_sampling_session",
            lambda w: {"session_id": w.session_id, "sampling_session_seq_id": 9, "base_model": "gpt-17"},
        ),
        400,
        "base_model",
    ),
    Case(
        "sampling session negative seq",
        post(
            "create_sampling_session",
            lambda w: {"session_id": w.session_id, "sampling_session_seq_id": -1, "base_model": ALIAS},
        ),
        422,
        "sampling_session_seq_id",
    ),
    Case(
        "weights_info no kind",
        post("weights_info", lambda w: {"tinker_path": f"tinker://{w.model_id}"}),
        400,
        "tinker_path",
    ),
    Case(
        "weights_info sampler checkpoint that does not exist",
        post("weights_info", lambda w: {"tinker_path": w.sampler_path + "-gone"}),
        404,
        "tinker_path",
    ),
    Case(
        "weights_info '..' run id",
        post("weights_info", lambda w: {"tinker_path": "tinker://../weights/good"}),
        400,
        "tinker_path",
    ),
    Case("weights_info missing tinker_path", post("weights_info", lambda w: {"path": "x"}), 422, "tinker_path"),
    # saving
    Case(
        "save_weights '../' name",
        post("save_weights", lambda w: {"model_id": w.model_id, "seq_id": w.next_seq(), "path": "../escape"}),
        400,
        "path",
    ),
    Case(
        "save_weights name with a trailing newline",
        post("save_weights", lambda w: {"model_id": w.model_id, "seq_id": w.next_seq(), "path": "good\n"}),
        400,
        "path",
    ),
    Case("download token that is not a link", rest("GET", lambda w: "files/31/00/x"), 404, "no such download"),
    Case(
        "download signature not ASCII",
        rest("GET", lambda w: f"files/{json.dumps(['r', 'weights', 'n', 1.0, 'f', 2**40]).encode().hex()}/%C3%A9/f"),
        403,
        "invalid or has expired",
    ),
    Case(
        "save_weights negative ttl",
        post(
            "save_weights", lambda w: {"model_id": w.model_id, "seq_id": w.next_seq(), "path": "t", "ttl_seconds": -5}
        ),
        400,
        "ttl_seconds",
    ),
    Case(
        "save_weights_for_sampler unknown kind",
        post(
            "save_weights_for_sampler",
            lambda w: {"model_id": w.model_id, "seq_id": w.next_seq(), "path": "k", "kind": "full"},
        ),
        400,
        "kind",
    ),
    Case(
        "save_weights_for_sampler neither name nor session",
        post("save_weights_for_sampler", lambda w: {"model_id": w.model_id, "seq_id": w.next_seq()}),
        400,
        "sampling_session_seq_id",
    ),
    # REST checkpoint routes
    Case(
        "REST delete '..' checkpoint",
        rest("DELETE", lambda w: f"training_runs/{w.model_id}/checkpoints/weights/%2E%2E"),
        400,
        "path",
    ),
    Case(
        "REST publish unknown kind",
        rest("POST", lambda w: f"training_runs/{w.good_run}/checkpoints/adapters/good/publish"),
        400,
        "kind",
    ),
    Case(
        "REST ttl too short",
        rest("PUT", lambda w: f"training_runs/{w.good_run}/checkpoints/weights/good/ttl", {"ttl_seconds": 1}),
        400,
        "ttl_seconds",
    ),
    Case(
        "REST ttl a string",
        rest("PUT", lambda w: f"training_runs/{w.good_run}/checkpoints/weights/good/ttl", {"ttl_seconds": "forever"}),
        422,
        "ttl_seconds",
    ),
    Case("REST unknown run", rest("GET", lambda w: "training_runs/sess-none:train:3/checkpoints"), 404, "training run"),
    Case(
        "REST download URLs of a weights checkpoint",
        rest("GET", lambda w: f"training_runs/{w.good_run}/checkpoints/weights/good/external_weights_urls"),
        400,
        "external_weights",
    ),
    Case("REST list limit 0", rest("GET", lambda w: "training_runs?limit=0"), 422, "limit"),
    Case("REST list offset negative", rest("GET", lambda w: "checkpoints?offset=-1"), 422, "offset"),
    # sessions, models, futures
    Case(
        "create_model rank 0",
        post(
            "create_model",
            lambda w: {"session_id": w.session_id, "model_seq_id": 50, "base_model": ALIAS, "lora_config": {"rank": 0}},
        ),
        422,
        "rank",
    ),
    Case(
        "create_model unknown base_model",
        post(
            "create_model",
            lambda w: {
                "session_id": w.session_id,
                "model_seq_id": 51,
                "base_model": "nope",
                "lora_config": {"rank": 4},
            },
        ),
        400,
        "base_model",
    ),
    Case(
        "create_model without lora_config",
        post("create_model", lambda w: {"session_id": w.session_id, "model_seq_id": 52, "base_model": ALIAS}),
        400,
        "lora_config",
    ),
    Case(
        "create_model optimizer_config {type: lion}",
        post(
            "create_model",
            lambda w: {
                "session_id": w.session_id,
                "model_seq_id": 60,
                "base_model": ALIAS,
                "lora_config": {"rank": 4},
                "optimizer_config": {"type": "lion"},
            },
        ),
        400,
        "optimizer_config.type 'lion'",
    ),
    Case(
        "create_model optimizer_config {type: dimuon, version: 2}",
        post(
            "create_model",
            lambda w: {
                "session_id": w.session_id,
                "model_seq_id": 61,
                "base_model": ALIAS,
                "lora_config": {"rank": 4},
                "optimizer_config": {"type": "dimuon", "version": 2},
            },
        ),
        400,
        "optimizer_config.version = 2",
    ),
    Case(
        "create_model optimizer_config {type: dimuon, momentum: 0.9}",
        post(
            "create_model",
            lambda w: {
                "session_id": w.session_id,
                "model_seq_id": 62,
                "base_model": ALIAS,
                "lora_config": {"rank": 4},
                "optimizer_config": {"type": "dimuon", "momentum": 0.9},
            },
        ),
        400,
        "optimizer_config.momentum",
    ),
    Case(
        "create_model optimizer_config {version: 1}",
        post(
            "create_model",
            lambda w: {
                "session_id": w.session_id,
                "model_seq_id": 63,
                "base_model": ALIAS,
                "lora_config": {"rank": 4},
                "optimizer_config": {"version": 1},
            },
        ),
        400,
        "optimizer_config.version",
    ),
    Case(
        "create_model optimizer_config dimuon",
        post(
            "create_model",
            lambda w: {
                "session_id": w.session_id,
                "model_seq_id": 64,
                "base_model": ALIAS,
                "lora_config": {"rank": 4},
                "optimizer_config": "dimuon",
            },
        ),
        422,
        "optimizer_config",
    ),
    Case(
        "load_weights optimizer_config with optimizer state",
        post(
            "load_weights",
            lambda w: {
                "session_id": w.session_id,
                "model_seq_id": 70,
                "path": w.weights_path,
                "optimizer": True,
                "optimizer_config": {"type": "dimuon", "version": 1},
            },
        ),
        400,
        "optimizer_config",
    ),
    Case(
        "load_weights changes an existing model's optimizer",
        post(
            "load_weights",
            lambda w: {
                "model_id": w.model_id,
                "seq_id": w.next_seq(),
                "path": w.weights_path,
                "optimizer": False,
                "optimizer_config": {"type": "dimuon", "version": 1},
            },
        ),
        400,
        "cannot change the optimizer",
    ),
    Case(
        "save_weights_external model_id a lone surrogate",
        post("save_weights_external", lambda w: {"model_id": "\ud800", "seq_id": 1, "path": "x"}),
        422,
        "unpaired surrogate",
    ),
    Case(
        "save_weights_external body not UTF-8",
        lambda w: w.post(
            "/api/v1/save_weights_external",
            content=b'{"model_id": "\xed\xa0\x80", "seq_id": 1',
            headers={"Content-Type": "application/json"},
        ),
        422,
        "JSON decode error",
    ),
    Case(
        "create_session tag a lone surrogate",
        post("create_session", lambda w: {"tags": ["ok", "\udfff"]}),
        422,
        "tags[1]",
    ),
    Case(
        "cancel_future unknown request_id",
        post("cancel_future", lambda w: {"request_id": "req-nope"}),
        404,
        "request_id",
    ),
    Case("cancel_future without request_id", post("cancel_future", lambda w: {}), 422, "request_id"),
    Case(
        "retrieve_futures unknown sampling session",
        post("retrieve_futures", lambda w: {"target": {"sampling_session_id": "samp-nope"}}),
        404,
        "target.sampling_session_id",
    ),
    Case(
        "retrieve_futures negative clone",
        post("retrieve_futures", lambda w: {"target": {"sampling_session_id": w.sampler_id, "cloned_sampler_id": -1}}),
        422,
        "cloned_sampler_id",
    ),
    Case(
        "retrieve_futures negative timeout",
        post("retrieve_futures", lambda w: {"target": {"sampling_session_id": w.sampler_id}, "timeout": -1}),
        422,
        "timeout",
    ),
    Case(
        "retrieve_futures cursor over int64",
        post("retrieve_futures", lambda w: {"target": {"sampling_session_id": w.sampler_id}, "prev_cursor": 2**64}),
        422,
        "prev_cursor",
    ),
    Case(
        "join_sampling_session unknown session",
        post("join_sampling_session", lambda w: {"sampling_session_id": "samp-nope"}),
        404,
        "sampling_session_id",
    ),
    Case(
        "create_model negative model_seq_id",
        post(
            "create_model",
            lambda w: {"session_id": w.session_id, "model_seq_id": -1, "base_model": ALIAS, "lora_config": {"rank": 4}},
        ),
        422,
        "model_seq_id",
    ),
    Case("create_session unknown key", post("create_session", lambda w: {"tags": [], "colour": "blue"}), 422, "colour"),
    # A control call is held to --max-control-body-bytes (1 MiB), declared or sent.
    Case(
        "control call declaring a body over its limit",
        declared_oversize("create_session", "application/json", size=(1 << 20) + 1),
        413,
        "--max-control-body-bytes",
    ),
    Case(
        "control call sending a body over its limit",
        post("create_session", lambda w: {"tags": [], "user_metadata": {"x": "y" * (1 << 20)}}),
        413,
        "--max-control-body-bytes",
    ),
    Case("create_session tags not a list", post("create_session", lambda w: {"tags": "a,b"}), 422, "tags"),
    # What a session keeps for good is bounded (each search reads it all)
    Case(
        "create_session display_name of 257",
        post("create_session", lambda w: {"display_name": "x" * 257}),
        422,
        "display_name",
    ),
    Case("create_session 65 tags", post("create_session", lambda w: {"tags": ["t"] * 65}), 422, "tags"),
    Case("create_session long tag", post("create_session", lambda w: {"tags": ["t" * 257]}), 422, "tags.0"),
    Case(
        "finish a session with a detail of 16K+1",
        post("sessions/x/finish", lambda w: {"reason": {"type": "success"}, "detail": "d" * 16385}),
        422,
        "detail",
    ),
    Case(
        "copy_weights into a project of control characters",
        post("copy_weights", lambda w: {"source_path": w.weights_path, "destination_project_id": "\x01\x02"}),
        400,
        "project_id",
    ),
    Case(
        "retrieve_future unknown id", post("retrieve_future", lambda w: {"request_id": "req-nope"}), 404, "request_id"
    ),
    Case("retrieve_future missing id", post("retrieve_future", lambda w: {}), 422, "request_id"),
    Case("get_info unknown model", post("get_info", lambda w: {"model_id": "sess-nope:train:0"}), 404, "model_id"),
    # OpenAI-compatible routes
    Case("chat no messages", openai("chat/completions", messages=[]), 400, "messages"),
    Case("chat messages not a list", openai("chat/completions", messages="hi"), 400, "messages"),
    Case("chat unknown role", openai("chat/completions", messages=[{"role": "robot", "content": "x"}]), 400, "role"),
    Case(
        "chat image content part",
        openai("chat/completions", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages[0].content",
    ),
    Case(
        "chat text part that is not text",
        openai("chat/completions", messages=[{"role": "user", "content": [{"type": "text", "text": 123}]}]),
        400,
        "messages[0].content",
    ),
    Case("chat negative max_tokens", openai("chat/completions", max_tokens=-1), 400, "max_tokens"),
    Case("chat huge max_tokens", openai("chat/completions", max_tokens=10**7), 400, "max_tokens"),
    Case("chat n 0", openai("chat/completions", n=0), 400, "n"),
    Case("chat n 1000", openai("chat/completions", n=1000), 400, "n"),
    Case("chat temperature 3", openai("chat/completions", temperature=3.0), 400, "temperature"),
    Case("chat top_logprobs 50", openai("chat/completions", logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    Case("chat unknown model", openai("chat/completions", model="gpt-17"), 404, "model"),
    Case("chat unknown key", openai("chat/completions", best_of=3), 400, "best_of"),
    Case("completion prompt id >= vocab", openai("completions", prompt=[5, 9999]), 400, "prompt"),
    Case("completion empty prompt", openai("completions", prompt=""), 400, "prompt"),
    Case("completion prompt over --max-seq-len", openai("completions", prompt=[5] * (MAX_SEQ_LEN + 1)), 400, "prompt"),
    Case("completion logprobs 50", openai("completions", logprobs=50), 400, "logprobs"),
    Case("completion echo", openai("completions", echo=True), 400, "echo"),
    Case("completion empty stop string", openai("completions", stop=[""]), 400, "stop"),
    Case("completion 500 stop strings", openai("completions", stop=[str(i) for i in range(500)]), 400, "stop"),
    Case(
        "completion text over 32 characters per token of context",
        openai("completions", prompt="x" * (32 * MAX_SEQ_LEN + 1)),
        400,
        "prompt",
    ),
    Case(
        "chat the model's template refuses",
        openai("chat/completions", messages=[{"role": "system", "content": "be brief"}]),
        400,
        "No user query found in messages.",
    ),
    Case(
        "chat text over 32 characters per token of context",
        openai("chat/completions", messages=[{"role": "user", "content": "x" * (32 * MAX_SEQ_LEN + 1)}]),
        400,
        "messages",
    ),
    Case("completion negative max_tokens", openai("completions", max_tokens=-3), 400, "max_tokens"),
    Case(
        "completion unknown tinker:// model", openai("completions", model="tinker://../sampler_weights/x"), 404, "model"
    ),
    Case(
        "completion invalid JSON",
        lambda w: w.post("/v1/completions", content=b"{'model': 1}", headers={"Content-Type": "application/json"}),
        400,
        "body",
    ),
    # Big bodies (body_thread.OFF_LOOP_BYTES or more) are parsed off the event loop; a million bad
    # items or unknown fields are one error (protocol.strict), not a million (seconds, and MiBs).
    Case(
        "sample a million bad target ids",
        sample(target_prompt_logprobs={"data": ["a"] * 10**6, "dtype": "int64"}),
        422,
        "target_prompt_logprobs.data",
    ),
    Case("sample a million unknown fields", sample(**{f"k{i}": 0 for i in range(10**6)}), 422, "k0"),
    Case(
        "sample big body not JSON",
        lambda w: w.post("/api/v1/asample", content=_big_broken_json(), headers=JSON),
        422,
        "body",
    ),
    Case(
        "sample big body nested too deep",
        lambda w: w.post("/api/v1/asample", content=b"[" * 10**6, headers=JSON),
        400,
        "body",
    ),
    Case(  # the same answer as a big body's, which is parsed on the body thread
        "sample small body nested too deep",
        lambda w: w.post("/api/v1/asample", content=b"[" * 10**4, headers=JSON),
        400,
        "body",
    ),
    Case(
        "sample big body not UTF-8",
        lambda w: w.post("/api/v1/asample", content=b'{"x": "' + b"\xff" * (1 << 17) + b'"}', headers=JSON),
        400,
        "body",
    ),
    Case("completion a million bad prompt ids", openai("completions", prompt=["a"] * 10**6), 400, "prompt"),
    Case("chat a million empty messages", openai("chat/completions", messages=[{}] * 10**6), 400, "messages"),
    Case(
        "chat big body not JSON",
        lambda w: w.post("/v1/chat/completions", content=_big_broken_json(), headers=JSON),
        400,
        "body",
    ),
]


def _big_broken_json() -> bytes:
    return b'{"model": "x", ' + b" " * (1 << 20) + b"'"


def _with_seq(body: bytes, seq_id: int) -> bytes:
    req = pb.ForwardBackwardRequest.FromString(body)
    req.seq_id = seq_id
    return req.SerializeToString()


def _with_model(body: bytes, model_id: str) -> bytes:
    req = pb.ForwardBackwardRequest.FromString(body)
    req.model_id = model_id
    return req.SerializeToString()


# ---- the same through the SDK, where it lets the bad value through ----------------------------


def _datum(tokens: list[int], **inputs: Any) -> types.Datum:
    """A datum of ``tokens`` with valid cross-entropy inputs; a keyword overrides one, ``...`` drops it."""
    inputs = {"target_tokens": [t + 1 for t in tokens], "weights": [1.0] * len(tokens), **inputs}
    kept = {k: v for k, v in inputs.items() if v is not ...}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=kept)


def _spanned(datum: types.Datum, sequence_id: str, inputs: int, targets: int | None = None) -> types.Datum:
    """``datum`` with provenance naming one sequence: prompt spans of ``inputs`` and ``targets``
    positions (built as the SDK would, without its own tiling check, so that a bad one is sent)."""
    from dataclasses import replace

    spans = [types.PromptProvenanceSpan(sequence_id=sequence_id, length=inputs)]
    loss = [types.PromptProvenanceSpan(sequence_id=sequence_id, length=targets if targets is not None else inputs)]
    return replace(datum, model_input_spans=spans, loss_fn_input_spans=loss)


def sdk_fb(datum: types.Datum, loss_fn: str = "cross_entropy", config: dict | None = None) -> Callable[[World], Any]:
    return lambda w: w.sdk["tc"].forward_backward([datum], loss_fn, loss_fn_config=config).result()


def sdk_optim(**adam: float) -> Callable[[World], Any]:
    return lambda w: w.sdk["tc"].optim_step(types.AdamParams(**adam)).result()


def sdk_sample(num_samples: int = 1, tokens: tuple[int, ...] = (5, 6, 7), **params: Any) -> Callable[[World], Any]:
    params.setdefault("max_tokens", 4)
    prompt = types.ModelInput.from_ints(list(tokens))
    return lambda w: w.sdk["sampler"].sample(prompt, num_samples, types.SamplingParams(**params)).result()


@dataclass(frozen=True)
class SdkCase:
    name: str
    call: Callable[[World], Any]
    status: int
    field: str


SDK_CASES: list[SdkCase] = [
    SdkCase("sdk target_tokens >= vocab", sdk_fb(_datum([5, 6, 7], target_tokens=[6, 7, 5000])), 400, "target_tokens"),
    SdkCase("sdk negative model_input token", sdk_fb(_datum([-3, 6, 7])), 400, "model_input"),
    SdkCase("sdk NaN weight", sdk_fb(_datum([5, 6, 7], weights=[1.0, math.nan, 1.0])), 400, "weights"),
    SdkCase("sdk weights length mismatch", sdk_fb(_datum([5, 6, 7], weights=[1.0, 1.0])), 400, "weights"),
    SdkCase(
        "sdk float target_tokens",
        sdk_fb(_datum([5, 6, 7], target_tokens=types.TensorData(data=[6.5, 7.5, 8.5], dtype="float32"))),
        400,
        "target_tokens",
    ),
    SdkCase(
        "sdk -inf advantage",
        sdk_fb(_datum([5, 6, 7], weights=..., logprobs=[-1.0] * 3, advantages=[1.0, -math.inf, 0.0]), "ppo"),
        400,
        "advantages",
    ),
    SdkCase("sdk unknown loss_fn", sdk_fb(_datum([5, 6, 7]), "bogus_loss"), 400, "loss_fn"),
    SdkCase(
        "sdk unknown loss_fn_config key", sdk_fb(_datum([5, 6, 7]), config={"temperature": 2.0}), 400, "temperature"
    ),
    SdkCase("sdk sequence over --max-seq-len", sdk_fb(_datum([5] * (MAX_SEQ_LEN + 1))), 400, "model_input"),
    SdkCase(
        "sdk unknown loss_fn_inputs key",
        sdk_fb(_datum([5, 6, 7], mask=np.ones(3, dtype=np.float32))),
        400,
        "loss_fn_inputs.mask",
    ),
    SdkCase("sdk empty model_input", sdk_fb(_datum([])), 400, "model_input"),
    SdkCase(
        "sdk NaN loss_fn_config",
        sdk_fb(
            _datum([5, 6, 7], weights=..., logprobs=[-1.0] * 3, advantages=[1.0] * 3),
            "ppo",
            {"clip_low_threshold": math.nan},
        ),
        400,
        "loss_fn_config.clip_low_threshold",
    ),
    # The SDK sends NaN as null: a 422, which must still consume the seq_id (the last test checks).
    # stable_reinforce and provenance spans
    SdkCase(
        "sdk stable_reinforce without provenance",
        sdk_fb(_datum([5, 6, 7], weights=..., advantages=[1.0] * 3), "stable_reinforce"),
        400,
        "provenance",
    ),
    SdkCase(
        "sdk span naming an unknown sequence_id",
        sdk_fb(
            _spanned(_datum([5, 6, 7], weights=..., advantages=[1.0] * 3), "sess-x:sample:0:1:0", 3), "stable_reinforce"
        ),
        400,
        "sequence_id",
    ),
    SdkCase(
        "sdk spans that do not tile the targets",
        sdk_fb(_spanned(_datum([5, 6, 7]), "sess-x:sample:0:1:0", 3, targets=2), "cross_entropy"),
        400,
        "loss_fn_input_spans",
    ),
    SdkCase(
        "sdk stable_reinforce sampled_mask from the client",
        sdk_fb(
            _datum([5, 6, 7], weights=..., advantages=[1.0] * 3, sampled_mask=np.ones(3, dtype=np.float32)),
            "stable_reinforce",
        ),
        400,
        "loss_fn_inputs.sampled_mask",
    ),
    SdkCase(
        "sdk load_state after the first request",
        lambda w: w.sdk["tc"].load_state(w.weights_path).result(),
        400,
        "seq_id",
    ),
    SdkCase("sdk NaN learning_rate", sdk_optim(learning_rate=math.nan), 422, "adam_params.learning_rate"),
    SdkCase("sdk negative learning_rate", sdk_optim(learning_rate=-1.0), 400, "learning_rate"),
    SdkCase("sdk beta1 = 1", sdk_optim(beta1=1.0), 400, "beta1"),
    SdkCase("sdk eps = 0", sdk_optim(eps=0.0), 400, "eps"),
    SdkCase("sdk sample negative max_tokens", sdk_sample(max_tokens=-1), 400, "max_tokens"),
    SdkCase("sdk sample num_samples 0", sdk_sample(num_samples=0), 400, "num_samples"),
    SdkCase("sdk sample stop id >= vocab", sdk_sample(stop=[99999]), 400, "stop"),
    SdkCase("sdk sample prompt id >= vocab", sdk_sample(tokens=(5, 100000)), 400, "prompt"),
    SdkCase("sdk sample top_p 0", sdk_sample(top_p=0.0), 400, "top_p"),
    SdkCase("sdk sample top_k 0", sdk_sample(top_k=0), 400, "top_k"),
    SdkCase(
        "sdk client from a non-tinker path",
        lambda w: w.sdk["sc"].create_training_client_from_state("not-a-path").result(),
        400,
        "path",
    ),
    SdkCase(
        "sdk client from a sampler path",
        lambda w: w.sdk["sc"].create_training_client_from_state(w.sampler_path).result(),
        400,
        "path",
    ),
    SdkCase("sdk save_state '../' name", lambda w: w.sdk["tc"].save_state("../escape").result(), 400, "path"),
    SdkCase(
        "sdk sampling client '..' run",
        lambda w: w.sdk["sc"].create_sampling_client(model_path="tinker://../sampler_weights/x").result(),
        400,
        "model_path",
    ),
    SdkCase(
        "sdk weights_info malformed",
        lambda w: w.sdk["rest"].get_weights_info_by_tinker_path("tinker://just-a-run").result(),
        400,
        "tinker_path",
    ),
    SdkCase(
        "sdk ttl too long",
        lambda w: w.sdk["rest"].set_checkpoint_ttl_from_tinker_path(w.weights_path, 10**12).result(),
        400,
        "ttl_seconds",
    ),
]


# ---- the tests --------------------------------------------------------------------------------


def _messages(body: Any) -> list[str]:
    """The human-readable parts of an error body: ours, FastAPI's 422 list, or OpenAI's."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        return [str(err.get("message")), str(err.get("param"))]
    if isinstance(body, dict) and isinstance(body.get("detail"), list):
        return [".".join(str(p) for p in e["loc"]) + ": " + e["msg"] for e in body["detail"]]
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return [body["detail"]]
    raise AssertionError(f"not a JSON error body: {body!r}")


def _check(status: int, body: Any, case: Case | SdkCase) -> None:
    assert 400 <= status < 500, f"{case.name}: {status} {body!r}"
    assert status == case.status, f"{case.name}: expected {case.status}, got {status} {body!r}"
    messages = _messages(body)
    # The field as a whole name: "n" must not be found inside "max_tokens", nor "path" in "model_path".
    named = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(case.field)}(?![A-Za-z0-9_])")
    assert any(named.search(m) for m in messages), f"{case.name}: {case.field!r} not named in {messages}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_raw_http(world: World, case: Case):
    reply = case.send(world)
    _check(reply.status, reply.body, case)
    assert_no_gap(world)


@pytest.mark.slow
@pytest.mark.parametrize("case", SDK_CASES, ids=lambda c: c.name)
def test_sdk(world: World, case: SdkCase):
    with pytest.raises(tinker.APIStatusError) as info:
        case.call(world)
    _check(info.value.status_code, info.value.body, case)
    assert_no_gap(world)


@pytest.mark.slow
def test_server_is_healthy_and_still_trains(world: World):
    """After the cases (whichever ran before): /healthz is green, neither model waits on a gap
    (each case checks its own too), and a normal SFT step through the SDK succeeds."""
    assert world.http.get("/healthz").status_code == 200
    req = _fb_request(world.model_id, world.next_seq())
    fb_id = world.post("/api/v1/forward_backward", content=req.SerializeToString(), headers=PROTOBUF).body
    body = {"model_id": world.model_id, "seq_id": world.next_seq(), "adam_params": {"learning_rate": 1e-3}}
    optim_id = world.post("/api/v1/optim_step", json_body=body).body
    assert world.result(fb_id["request_id"]).metrics["loss:sum"] > 0
    assert world.result(optim_id["request_id"])["metrics"]

    tc = world.sdk["tc"]
    datum = _datum([5, 6, 7, 8])
    losses = []
    for _ in range(3):
        losses.append(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    out = world.sdk["sampler"].sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=3))
    assert len(out.result().sequences[0].tokens) <= 3
    health = world.http.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"


@pytest.mark.slow
def test_a_large_prompt_body_samples_as_a_small_one(world: World):
    """A body past ``body_thread.OFF_LOOP_BYTES`` (here: JSON padded with whitespace) is parsed on
    the body thread, and answered exactly as the same request in a small body."""
    body = {
        "sampling_session_id": world.sampler_id,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
        "sampling_params": {"max_tokens": 6, "seed": 11},
        "num_samples": 2,
    }
    small = json.dumps(body).encode()
    big = small[:-1] + b" " * (256 << 10) + b"}"
    answers = []
    for content in (small, big):
        future = world.post("/api/v1/asample", content=content, headers=JSON)
        assert future.status == 200, future.body
        reply = world.http.post("/api/v1/retrieve_future", json={"request_id": future.body["request_id"]}, timeout=60)
        answers.append([list(s.tokens) for s in deserialize_sample_response(reply.content).sequences])
    assert answers[0] == answers[1] and answers[0][0]

    chat = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "seed": 3}
    texts = []
    for pad in (b"", b" " * (256 << 10)):
        reply = world.post("/v1/chat/completions", content=json.dumps(chat).encode() + pad, headers=JSON)
        assert reply.status == 200, reply.body
        texts.append(reply.body["choices"][0]["message"]["content"])
    assert texts[0] == texts[1]


@pytest.mark.slow
def test_a_422_lists_the_first_errors_and_counts_the_rest(world: World):
    """A body with many errors is answered with the first ``errors.MAX_REPORTED`` and a count of
    the rest: a small answer, however bad the body."""
    unknown = {f"k{i}": 0 for i in range(8)}  # 8: each named where it is (protocol.strict)
    body = {**unknown, "owner": unknown, "cursor": unknown, "statuses": [unknown]}
    reply = world.post("/api/v1/sessions/search", json_body=body)
    assert reply.status == 422
    detail = reply.body["detail"]
    assert detail[0]["loc"] == ["body", "owner", "k0"] and len(detail) == 21
    assert detail[-1]["type"] == "more_errors" and re.fullmatch(r"\d+ more errors not shown", detail[-1]["msg"])

    for many in ({"user_metadata": {f"k{i}": i for i in range(50_000)}}, {f"k{i}": 0 for i in range(50_000)}):
        reply = world.post("/api/v1/sessions/search", json_body=many)
        assert reply.status == 422 and len(reply.body["detail"]) == 1, reply.body
    targets = {"data": ["a"] * 10**6, "dtype": "int64"}
    reply = sample(target_prompt_logprobs=targets)(world)
    assert reply.status == 422 and len(json.dumps(reply.body)) < 2048, reply.body


MIN_CASES = 40


@pytest.mark.fast
def test_the_table_holds_enough_distinct_cases():
    names = [c.name for c in CASES + SDK_CASES]
    assert len(names) == len(set(names)), "case names must be unique"
    assert len(set(names)) >= MIN_CASES, len(set(names))
