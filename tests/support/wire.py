"""The HTTP protocol by hand: an ``Api`` client with the test key, forward_backward bodies, protobuf request bytes."""

from __future__ import annotations

import httpx
import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from tests.support.server import ALIAS


def fwdbwd_body(model_id: str, seq_id: int, n_datums: int = 1, length: int = 16, **kw) -> bytes:
    req = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy", **kw)
    rng = np.random.default_rng(seq_id)
    for _ in range(n_datums):
        tokens = rng.integers(10, 500, length + 1)
        d = req.data.add()
        d.model_input.add().encoded_text.tokens = tokens[:-1].astype("<i4").tobytes()
        d.loss_fn_inputs["target_tokens"].CopyFrom(
            pb.Tensor(dense=tokens[1:].astype("<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[length])
        )
        d.loss_fn_inputs["weights"].CopyFrom(
            pb.Tensor(dense=np.ones(length, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[length])
        )
    return req.SerializeToString()


class Api:
    def __init__(self, base_url: str) -> None:
        self.http = httpx.Client(base_url=base_url, headers=HEADERS, timeout=60)

    def post(self, path: str, **kw) -> httpx.Response:
        return self.http.post(f"/api/v1/{path}", **kw)

    def new_model(self) -> str:
        session = self.post("create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
        body = {"session_id": session, "model_seq_id": 0, "base_model": ALIAS, "lora_config": {"rank": 4, "seed": 0}}
        fut = self.post("create_model", json=body).json()
        return self.result(fut["request_id"])["model_id"]

    def fwdbwd(self, body: bytes, **headers) -> str:
        r = self.post("forward_backward", content=body, headers={"Content-Type": "application/x-protobuf", **headers})
        assert r.status_code == 200, r.text
        return r.json()["request_id"]

    def poll(self, request_id: str) -> httpx.Response:
        return self.post("retrieve_future", json={"request_id": request_id})

    def result(self, request_id: str):
        while True:
            r = self.poll(request_id)
            assert r.status_code == 200, r.text
            if r.headers["content-type"].startswith("application/x-protobuf"):
                return deserialize_forward_backward_output(r.content)
            body = r.json()
            if body.get("type") != "try_again":
                return body


def make_request_bytes(
    data: list[types.Datum],
    loss_fn: str = "cross_entropy",
    loss_fn_config: dict | None = None,
    forward_only: bool = False,
    model_id: str = "sess-1:train:0",
    seq_id: int = 7,
) -> bytes:
    """Serialise exactly like ``AsyncTrainingResource.forward_backward`` does (minus zstd)."""
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config),
        model_id=model_id,
        seq_id=seq_id,
    )
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = forward_only
    return msg.SerializeToString()


HEADERS = {"X-API-Key": "tml-test"}
