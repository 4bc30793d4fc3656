"""``protocol.ordering.order_of``: a request's ``(model_id, seq_id)`` from the head of its body,
as the SDK encodes it (its own protobuf and JSON encoders), cut anywhere."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from hosted_tinker.server.protocol.ordering import HEAD_BYTES, head_limit, order_of

pytestmark = pytest.mark.fast

MODEL, SEQ = "sess-0123:train:7", 300  # a seq_id that takes two varint bytes
PROTOBUF = "application/x-protobuf"


def sdk_forward_backward(tokens: int) -> bytes:
    """A forward_backward body as SDK 0.38 sends it, of one datum of ``tokens`` random tokens."""
    rng = np.random.default_rng(0)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(rng.integers(0, 50_000, tokens).tolist()),
        loss_fn_inputs={
            "target_tokens": rng.integers(0, 50_000, tokens).tolist(),
            "weights": rng.random(tokens).astype(np.float32).tolist(),
        },
    )
    fb_input = types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")
    request = types.ForwardBackwardRequest(forward_backward_input=fb_input, model_id=MODEL, seq_id=SEQ)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_protobuf_whole_and_cut_anywhere_after_the_seq_id():
    body = sdk_forward_backward(100_000)
    assert len(body) > 4 * HEAD_BYTES
    assert order_of(body[:HEAD_BYTES], PROTOBUF) == (MODEL, SEQ)
    order_end = 2 + len(MODEL) + 3  # model_id's tag, length and text; seq_id's tag and 2 bytes
    for cut in range(order_end, order_end + 40):
        assert order_of(body[:cut], PROTOBUF) == (MODEL, SEQ), cut
    small = sdk_forward_backward(4)
    assert order_of(small, PROTOBUF) == (MODEL, SEQ)


def test_protobuf_cut_before_the_seq_id_is_complete_names_no_order():
    body = sdk_forward_backward(8)
    model_only = 2 + len(MODEL)
    assert order_of(body[:model_only], PROTOBUF) == (MODEL, 0)  # seq 0: refused as out of range
    assert order_of(body[: model_only - 1], PROTOBUF) is None
    assert order_of(body[:0], PROTOBUF) is None


@pytest.mark.parametrize("garbage", [b"\xff\xff\xff\xff not a protobuf", b"\x00" * 64, b"\n\x00", b"\n\xff\xff"])
def test_protobuf_garbage_names_no_order(garbage: bytes):
    assert order_of(garbage, PROTOBUF) is None


def test_zstd_head_inflates_to_the_order():
    body = sdk_forward_backward(200_000)  # random values: zstd barely shrinks them
    compressed = zstandard.ZstdCompressor().compress(body)
    assert len(compressed) > 2 * head_limit("zstd") and head_limit("zstd") > HEAD_BYTES
    assert order_of(compressed[: head_limit("zstd")], PROTOBUF, "zstd") == (MODEL, SEQ)
    assert order_of(compressed[:64], PROTOBUF, "zstd") is None  # no whole block yet
    assert order_of(b"\x28\xb5\x2f\xfd" + b"garbage" * 8, PROTOBUF, "zstd") is None
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20))
    assert order_of(bomb, PROTOBUF, "zstd") is None  # inflates no further than the head


@pytest.mark.parametrize(
    "request_type",
    [
        lambda meta: types.OptimStepRequest(
            adam_params=types.AdamParams(learning_rate=1e-4), model_id=MODEL, seq_id=SEQ
        ),
        lambda meta: types.SaveWeightsRequest(model_id=MODEL, path="w", seq_id=SEQ, user_metadata=meta),
        lambda meta: types.SaveWeightsForSamplerRequest(model_id=MODEL, path="s", seq_id=SEQ, user_metadata=meta),
        lambda meta: types.LoadWeightsRequest(model_id=MODEL, seq_id=SEQ, path="tinker://x/weights/w", optimizer=True),
    ],
    ids=["optim_step", "save_weights", "save_weights_for_sampler", "load_weights"],
)
def test_json_as_the_sdk_orders_its_fields(request_type):
    """The SDK's JSON puts model_id and seq_id ahead of anything large (``user_metadata``)."""
    body = request_type({"pad": "x" * (4 * HEAD_BYTES)}).model_dump_json(exclude_unset=True).encode()
    assert order_of(body[:HEAD_BYTES], "application/json") == (MODEL, SEQ)
    assert order_of(body, "application/json") == (MODEL, SEQ)


def test_json_heads_that_name_no_order():
    ok = b'{"model_id": "m", "seq_id": 3, "path": "w"}'
    assert order_of(ok, "application/json") == ("m", 3)
    assert order_of(b' \n{ "seq_id" :3 ,"model_id":"m" ,', "application/json") == ("m", 3)
    for head in [
        b'{"pad": "' + b"x" * 100,  # the fields come after a value the head cuts off
        b'{"model_id": "m", "seq_id": 3.0}',  # not an integer
        b'{"model_id": "m", "seq_id": true}',
        b'{"model_id": 5, "seq_id": 3}',
        b'{"model_id": "m", "seq_id": 3',  # cut inside the number: 3 might be 31
        b'[{"model_id": "m", "seq_id": 3}]',
        b'{"inner": {"model_id": "m", "seq_id": 3}}',  # not at the top level
        b'{"model_id": "m\\ud800", "seq_id": 3}',  # a lone surrogate: no model is named so
        b"not json",
        b"",
    ]:
        assert order_of(head, "application/json") is None, head
