"""``protocol.proto_scan``: the walk that bounds a ``ForwardBackwardRequest`` before protobuf
builds it. The audit's bombs (millions of empty datums, of empty chunks, of shape dimensions, of
repeated header fields) stop at the first bound, fast; what the SDK sends passes untouched."""

from __future__ import annotations

import time

import pytest
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from hosted_tinker.core.errors import WireError
from hosted_tinker.server.protocol.proto_codec import decode_forward_backward, decompress
from hosted_tinker.server.protocol.proto_scan import MAX_DATUMS, MAX_FIELDS, scan_forward_backward
from tests.support.wire import make_request_bytes

pytestmark = pytest.mark.fast

HEADER = pb.ForwardBackwardRequest(model_id="sess-1:train:0", seq_id=1, loss_fn="cross_entropy").SerializeToString()


def _refused(body: bytes, needle: str, **kw) -> WireError:
    started = time.perf_counter()
    with pytest.raises(WireError, match=needle) as info:
        scan_forward_backward(body, **kw)
    assert time.perf_counter() - started < 10  # the bomb walked in full would take minutes
    return info.value


def test_the_audits_bomb_stops_at_the_first_datum_over_the_bound():
    """16.8 M empty datums (two bytes each, 32 MiB) zstd-compressed to a few KB: inflated, the
    walk stops at datum 4,097, and protobuf built none of them."""
    empty_datums = b"\x1a\x00" * (16_800_000)
    bomb = zstandard.ZstdCompressor(level=19).compress(HEADER + empty_datums)
    assert len(bomb) < 4096
    raw = decompress(bomb, "zstd", 256 << 20)
    _refused(raw, rf"^data: over {MAX_DATUMS} values in one ForwardBackwardRequest$")


@pytest.mark.parametrize(
    "inner, needle",
    [
        (b"\x0a\x00" * 300, r"data\[0\]\.model_input: over 256 values in one Datum"),
        (b"\x12\x00" * 100, r"data\[0\]\.loss_fn_inputs: over 64 values in one Datum"),
        # shape dimensions, unpacked and packed (a packed run is one field of many values)
        (b"\x12\x06\x12\x04" + b"\x20\x01" * 2, None),
        (b"\x12\x16\x12\x14" + b"\x20\x01" * 10, r"loss_fn_inputs\[0\]\.value\.shape: over 8 values in one Tensor"),
        (b"\x12\x10\x12\x0e\x22\x0c" + b"\x01" * 12, r"loss_fn_inputs\[0\]\.value\.shape: over 8 values in one Tensor"),
        # a singular message repeated: protobuf would merge the two, growing the first's lists
        (b"\x12\x04\x12\x02\x1a\x00" + b"\x12\x04\x12\x02\x1a\x00", None),
        (b"\x12\x08\x12\x00\x12\x00\x12\x00\x12\x00", r"loss_fn_inputs\[0\]\.value occurs 2 times"),
    ],
)
def test_each_repeated_field_is_bounded_per_message(inner: bytes, needle: str | None):
    body = HEADER + b"\x1a" + _varint(len(inner)) + inner
    if needle is None:
        scan_forward_backward(body)
    else:
        _refused(body, needle)


def test_a_body_of_nothing_but_repeated_scalars_stops_at_the_field_bound():
    """A million repeated ``seq_id``s make no object, but walking 50 million would take the CPU."""
    _refused(b"\x10\x01" * (MAX_FIELDS + 1), rf"over {MAX_FIELDS} protobuf fields")


def test_tokens_are_counted_while_walking():
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(100))), loss_fn_inputs={"target_tokens": list(range(100))}
    )
    body = make_request_bytes([datum] * 11)
    assert scan_forward_backward(body, max_tokens=1100).tokens == 1100
    _refused(
        body, r"data\[10\]\.model_input\[0\]\.encoded_text\.tokens: the request holds over 1000 tokens", max_tokens=1000
    )


@pytest.mark.parametrize(
    "body, needle",
    [
        (b"\xff\xff\xff\xff", "a truncated or overlong varint"),
        (b"\x0a\xff\x01abc", r"model_id: truncated: 255 bytes declared, 3 left"),
        (b"\x1b", "wire type 3"),
        (b"\x18\x05", "data: a message sent as wire type 0"),
    ],
)
def test_malformed_bodies_name_the_field(body: bytes, needle: str):
    error = _refused(body, needle)
    assert str(error).startswith("body is not a ForwardBackwardRequest protobuf")


def test_the_sdks_requests_decode_as_before_with_datums_built_on_demand():
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(list(range(5 + i))),
            loss_fn_inputs={"target_tokens": list(range(5 + i)), "weights": [0.5] * (5 + i)},
        )
        for i in range(3)
    ]
    body = make_request_bytes(data, loss_fn_config={"clip": 0.2}, seq_id=9)
    req = decode_forward_backward(body, max_tokens=100)
    assert (req.model_id, req.seq_id, req.loss_fn, req.num_datums) == ("sess-1:train:0", 9, "cross_entropy", 3)
    assert req.loss_fn_config == {"clip": 0.2}
    built = req.datums()
    assert [d.tokens.tolist() for d in built] == [list(range(5 + i)) for i in range(3)]
    assert [d.loss_fn_inputs["weights"].tolist() for d in built] == [[0.5] * (5 + i) for i in range(3)]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def test_a_zstd_body_is_walked_as_it_inflates_and_the_bomb_stops_early():
    """From the benchmark: each bomb still inflated all its 32 MiB (0.14 s of a CPU) before the
    walk refused it; its start is now walked at each fourfold of its size, from 64 KiB."""
    from hosted_tinker.server.protocol.proto_scan import check_prefix

    bomb = zstandard.ZstdCompressor(level=19).compress(HEADER + b"\x1a\x00" * 16_800_000)
    inflated: list[int] = []
    with pytest.raises(WireError, match=rf"data: over {MAX_DATUMS} values"):
        decompress(bomb, "zstd", 256 << 20, charge=inflated.append, check=check_prefix)
    assert sum(inflated) < 4 << 20  # of 32 MiB

    # An SDK body of 3,000 datums inflates whole, walked on the way, and decodes as before.
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(list(range(i % 50, i % 50 + 100))),
            loss_fn_inputs={"target_tokens": list(range(100)), "weights": [0.5] * 100},
        )
        for i in range(3000)
    ]
    body = make_request_bytes(data)
    walked: list[int] = []
    raw = decompress(
        zstandard.ZstdCompressor().compress(body),
        "zstd",
        256 << 20,
        check=lambda b: walked.append(len(b)) or check_prefix(b),
    )
    assert bytes(raw) == body and len(walked) >= 2
    assert decode_forward_backward(raw).num_datums == 3000


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 40, 41, 200])
def test_a_bodys_start_passes_wherever_it_is_cut(cut: int):
    from hosted_tinker.server.protocol.proto_scan import check_prefix

    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(30))), loss_fn_inputs={"target_tokens": list(range(30))}
    )
    body = make_request_bytes([datum] * 3)
    check_prefix(body[:cut])
    check_prefix(bytearray(body[:cut]))
