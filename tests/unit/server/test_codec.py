"""Unit tests of the forward_backward protobuf codec (``hosted_tinker.protocol.proto_codec``).

Requests are built and serialised by the real tinker SDK (``request_conv``), responses are read
back by the SDK's own ``response_conv``, so both directions are checked against the client that
actually talks to the server. Malformed bodies are built by hand with ``tinker_public_pb2``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import deserialize_forward_backward_output

from hosted_tinker.core.errors import WireError
from hosted_tinker.server.protocol.proto_codec import (
    WireForwardBackward,
    WireImage,
    decode_forward_backward,
    decompress,
    encode_forward_backward_output,
)
from tests.support.wire import make_request_bytes

pytestmark = pytest.mark.fast

# ---- helpers --------------------------------------------------------------------------------


def sparse_datum(tokens: list[int], inputs: dict) -> types.Datum:
    with warnings.catch_warnings():  # torch's "sparse CSR support is in beta" warning
        warnings.simplefilter("ignore")
        return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def valid_msg() -> pb.ForwardBackwardRequest:
    """A small valid request as a proto message, to be corrupted by the malformed-body tests.

    Datum 1 has 2 positions, so a corrupted 2-row sparse tensor there is aligned with it.
    """
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={
            "target_tokens": np.array([2, 3, 4, 5], dtype=np.int64),
            "weights": np.array([0.0, 1.0, 1.0, 1.0], dtype=np.float32),
        },
    )
    short = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={
            "target_tokens": np.array([2, 3], dtype=np.int64),
            "weights": np.array([1.0, 1.0], dtype=np.float32),
        },
    )
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(make_request_bytes([datum, short]))
    return msg


def csr_tensor(shape, values, crow, col, dtype=pb.DTYPE_FLOAT32) -> pb.Tensor:
    t = pb.Tensor(dtype=dtype, shape=list(shape))
    np_dtype = {pb.DTYPE_FLOAT32: "<f4", pb.DTYPE_INT64: "<i8"}[dtype]
    t.sparse_csr.values = np.asarray(values, dtype=np_dtype).tobytes()
    t.sparse_csr.crow_indices = np.asarray(crow, dtype="<i8").tobytes()
    t.sparse_csr.col_indices = np.asarray(col, dtype="<i8").tobytes()
    return t


def decode_with_input(tensor: pb.Tensor, key: str = "weights", index: int = 1):
    msg = valid_msg()
    msg.data[index].loss_fn_inputs[key].CopyFrom(tensor)
    return decode_forward_backward(msg.SerializeToString())


def assert_wire_error(fn, *fragments: str) -> WireError:
    with pytest.raises(WireError) as info:
        result = fn()
        if isinstance(result, WireForwardBackward):
            result.datums()  # datums are decoded on demand, after the header
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    return info.value


# ---- request decoding: round trips through the SDK ---------------------------------------------


def test_dense_round_trip_ppo():
    rng = np.random.default_rng(0)
    data = []
    expected = []
    for n in (5, 3):
        tokens = rng.integers(0, 150_000, size=n).tolist()
        inputs = {
            "target_tokens": rng.integers(0, 150_000, size=n).astype(np.int64),
            "logprobs": rng.normal(-2.0, 1.0, size=n).astype(np.float32),
            "advantages": rng.normal(0.0, 1.0, size=n).astype(np.float32),
            "clip_low_threshold": np.full(n, 0.75, dtype=np.float32),
        }
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs))
        expected.append((tokens, inputs))
    body = make_request_bytes(
        data,
        loss_fn="ppo",
        loss_fn_config={"clip_low_threshold": 0.7, "clip_high_threshold": 1.3},
        model_id="sess-9:train:2",
        seq_id=42,
    )
    req = decode_forward_backward(body)
    assert req.model_id == "sess-9:train:2"
    assert req.seq_id == 42
    assert req.loss_fn == "ppo"
    assert req.forward_only is False
    assert req.loss_fn_config == {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    assert len(req.datums()) == 2
    for got, (tokens, inputs) in zip(req.datums(), expected, strict=True):
        assert got.tokens.dtype == np.int64
        assert got.tokens.tolist() == tokens
        assert set(got.loss_fn_inputs) == set(inputs)
        for key, want in inputs.items():
            arr = got.loss_fn_inputs[key]
            assert arr.shape == want.shape, key
            assert arr.dtype == want.dtype, key
            np.testing.assert_array_equal(arr, want)
            assert arr.flags.writeable, key  # a copy, not a view of the request bytes


def test_multiple_text_chunks_are_concatenated():
    mi = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[10, 11]), types.EncodedTextChunk(tokens=[12, 13, 14])])
    datum = types.Datum(model_input=mi, loss_fn_inputs={"weights": np.ones(5, dtype=np.float32)})
    req = decode_forward_backward(make_request_bytes([datum]))
    assert req.datums()[0].tokens.tolist() == [10, 11, 12, 13, 14]
    assert req.datums()[0].tokens.dtype == np.int64


def test_large_token_ids_and_empty_model_input():
    big = [0, 2**31 - 1, 151_935]
    datum = types.Datum(model_input=types.ModelInput.from_ints(big), loss_fn_inputs={})
    empty = types.Datum(model_input=types.ModelInput(chunks=[]), loss_fn_inputs={})
    req = decode_forward_backward(make_request_bytes([datum, empty]))
    assert req.datums()[0].tokens.tolist() == big
    assert req.datums()[1].tokens.shape == (0,)
    assert req.datums()[1].tokens.dtype == np.int64
    assert req.datums()[1].loss_fn_inputs == {}


def test_topk_targets_auto_sparsified_to_csr():
    n, k = 6, 4
    target = torch.zeros(n, k, dtype=torch.int64)
    target[:, 0] = torch.arange(100, 100 + n)
    target[2, 3] = 77
    weights = torch.zeros(n, k)
    weights[:, 0] = 1.0
    weights[2, 1] = -0.5
    weights[4, 3] = 0.25
    datum = sparse_datum(list(range(n)), {"target_tokens": target, "weights": weights})
    body = make_request_bytes([datum])
    # the SDK really did send CSR for both (otherwise this test would not exercise that path)
    msg = pb.ForwardBackwardRequest.FromString(body)
    for key in ("target_tokens", "weights"):
        assert msg.data[0].loss_fn_inputs[key].HasField("sparse_csr"), key
    req = decode_forward_backward(body)
    got = req.datums()[0].loss_fn_inputs
    assert got["target_tokens"].shape == (n, k)
    assert got["target_tokens"].dtype == np.int64
    np.testing.assert_array_equal(got["target_tokens"], target.numpy())
    assert got["weights"].shape == (n, k)
    assert got["weights"].dtype == np.float32
    np.testing.assert_array_equal(got["weights"], weights.numpy())


def test_topk_targets_dense_2d():
    rng = np.random.default_rng(1)
    n, k = 5, 3
    target = rng.integers(1, 1000, size=(n, k)).astype(np.int64)
    weights = rng.dirichlet(np.ones(k), size=n).astype(np.float32)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(n))),
        loss_fn_inputs={"target_tokens": target, "weights": weights},
    )
    body = make_request_bytes([datum])
    msg = pb.ForwardBackwardRequest.FromString(body)
    assert msg.data[0].loss_fn_inputs["weights"].WhichOneof("encoding") == "dense"
    got = decode_forward_backward(body).datums()[0].loss_fn_inputs
    assert got["target_tokens"].shape == (n, k)
    assert got["weights"].shape == (n, k)
    np.testing.assert_array_equal(got["target_tokens"], target)
    np.testing.assert_array_equal(got["weights"], weights)


def test_sparse_with_empty_rows_and_empty_matrix():
    weights = torch.zeros(7, 5)
    weights[3, 2] = 2.5  # rows 0-2 and 4-6 have no entries
    none = torch.zeros(4, 6)  # no entries at all
    datum = sparse_datum(list(range(7)), {"weights": weights})
    datum2 = sparse_datum(list(range(4)), {"weights": none})
    body = make_request_bytes([datum, datum2])
    msg = pb.ForwardBackwardRequest.FromString(body)
    assert msg.data[0].loss_fn_inputs["weights"].HasField("sparse_csr")
    assert msg.data[1].loss_fn_inputs["weights"].HasField("sparse_csr")
    req = decode_forward_backward(body)
    np.testing.assert_array_equal(req.datums()[0].loss_fn_inputs["weights"], weights.numpy())
    np.testing.assert_array_equal(req.datums()[1].loss_fn_inputs["weights"], np.zeros((4, 6), np.float32))


def test_unsorted_csr_columns_are_accepted():
    t = csr_tensor((2, 4), [1.0, 2.0, 3.0], [0, 2, 3], [3, 1, 0])
    got = decode_with_input(t).datums()[1].loss_fn_inputs["weights"]
    np.testing.assert_array_equal(got, [[0, 2, 0, 1], [3, 0, 0, 0]])


def test_tensor_without_shape_is_1d():
    td = types.TensorData(data=[0.5, -1.0, 2.0], dtype="float32")
    assert td.shape is None
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"weights": td})
    got = decode_forward_backward(make_request_bytes([datum])).datums()[0].loss_fn_inputs["weights"]
    np.testing.assert_array_equal(got, np.array([0.5, -1.0, 2.0], dtype=np.float32))


def test_int32_dense_tensor():
    t = pb.Tensor(dtype=pb.DTYPE_INT32, shape=[3], dense=np.array([5, -6, 7], "<i4").tobytes())
    got = decode_with_input(t, key="target_tokens").datums()[1].loss_fn_inputs["target_tokens"]
    assert got.tolist() == [5, -6, 7]


def test_loss_fn_config_numbers_and_text():
    datum = types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={})
    body = make_request_bytes([datum], loss_fn="dro", loss_fn_config={"beta": 0.125, "n": 3, "mode": "x", "empty": ""})
    cfg = decode_forward_backward(body).loss_fn_config
    assert cfg == {"beta": 0.125, "n": 3.0, "mode": "x", "empty": ""}
    assert isinstance(cfg["n"], float)
    assert isinstance(cfg["mode"], str)


def test_loss_fn_config_legacy_map_only():
    # an SDK predating loss_fn_config_v2 sends only the numeric legacy map
    msg = valid_msg()
    msg.loss_fn_config["clip_low_threshold"] = 0.6
    msg.loss_fn_config["clip_high_threshold"] = 1.4
    assert decode_forward_backward(msg.SerializeToString()).loss_fn_config == {
        "clip_low_threshold": 0.6,
        "clip_high_threshold": 1.4,
    }


def test_loss_fn_config_v2_wins_over_legacy():
    msg = valid_msg()
    msg.loss_fn_config["beta"] = 1.0
    msg.loss_fn_config_v2["beta"].number = 0.25
    msg.loss_fn_config_v2["loss_id"].text = "abc"
    assert decode_forward_backward(msg.SerializeToString()).loss_fn_config == {"beta": 0.25, "loss_id": "abc"}


def test_no_config():
    datum = types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={})
    assert decode_forward_backward(make_request_bytes([datum])).loss_fn_config == {}


def test_forward_only():
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": np.array([2, 3]), "weights": np.zeros(2, np.float32)},
    )
    req = decode_forward_backward(make_request_bytes([datum], forward_only=True))
    assert req.forward_only is True
    assert req.loss_fn == "cross_entropy"
    assert decode_forward_backward(make_request_bytes([datum], forward_only=False)).forward_only is False


def test_empty_request():
    req = decode_forward_backward(b"")
    assert req.datums() == [] and req.model_id == "" and req.seq_id == 0 and req.loss_fn_config == {}


# ---- decompress ---------------------------------------------------------------------------------


def test_decompress_zstd_round_trip():
    rng = np.random.default_rng(2)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(rng.integers(0, 1000, 3000).tolist()),
        loss_fn_inputs={"weights": np.ones(3000, np.float32)},
    )
    body = make_request_bytes([datum])
    compressed = zstandard.ZstdCompressor().compress(body)
    assert len(compressed) < len(body)
    for encoding in ("zstd", "ZSTD", "Zstd"):
        assert decompress(compressed, encoding, len(body)) == body
    req = decode_forward_backward(decompress(compressed, "zstd", 10 * len(body)))
    assert req.datums()[0].tokens.size == 3000


def test_decompress_streamed_frame_without_content_size():
    data = bytes(range(256)) * 5000
    cobj = zstandard.ZstdCompressor().compressobj()
    compressed = cobj.compress(data) + cobj.flush()
    assert decompress(compressed, "zstd", len(data)) == data


def test_decompress_many_frames_of_every_size():
    """Frames end inside the pieces the decoder reads: the next frame must start exactly there."""
    chunks = [bytes([i % 251]) * (i % 700) + bytes(range(i % 256)) for i in range(3000)]
    compressed = b"".join(zstandard.ZstdCompressor(level=i % 5 + 1).compress(c) for i, c in enumerate(chunks))
    assert decompress(compressed, "zstd", 10 << 20) == b"".join(chunks)


@pytest.mark.parametrize("encoding", [None, "", "identity", "IDENTITY"])
def test_decompress_identity(encoding):
    body = b"\x0a\x03abc not compressed"
    assert decompress(body, encoding, 1) is body  # max_bytes only limits inflation


def test_decompress_exactly_max_bytes_is_allowed():
    data = b"x" * 10_000
    assert decompress(zstandard.ZstdCompressor().compress(data), "zstd", 10_000) == data


def test_decompress_bomb_rejected():
    data = b"\0" * 5_000_000
    compressed = zstandard.ZstdCompressor(level=19).compress(data)
    assert len(compressed) < 1000
    assert_wire_error(lambda: decompress(compressed, "zstd", 4_999_999), "exceeds", "4999999")
    assert_wire_error(lambda: decompress(compressed, "zstd", 1024), "exceeds")


def test_decompress_bomb_without_content_size_rejected():
    cobj = zstandard.ZstdCompressor().compressobj()
    compressed = cobj.compress(b"\0" * 2_000_000) + cobj.flush()
    assert_wire_error(lambda: decompress(compressed, "zstd", 100_000), "exceeds")


def test_decompress_invalid_zstd():
    assert_wire_error(lambda: decompress(b"definitely not zstd", "zstd", 1000), "zstd")


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate", "zstd;q=1"])
def test_decompress_unsupported_encoding(encoding):
    assert_wire_error(lambda: decompress(b"abc", encoding, 1000), "Content-Encoding", encoding)


def test_decompress_multiple_frames_are_concatenated():
    # RFC 8878 §3.1: zstd data is "one or more frames"; a decoder must return all of them.
    # BUG: the codec's stream_reader stops at the end of the first frame and silently drops
    # the rest (here it returns only the first half of the request body).
    body = make_request_bytes(
        [
            types.Datum(
                model_input=types.ModelInput.from_ints(list(range(50))),
                loss_fn_inputs={"weights": np.ones(50, np.float32)},
            )
        ]
        * 4
    )
    half = len(body) // 2
    compressed = zstandard.ZstdCompressor().compress(body[:half]) + zstandard.ZstdCompressor().compress(body[half:])
    # the zstd library itself, reading across frames, recovers the whole body
    with zstandard.ZstdDecompressor().stream_reader(compressed, read_across_frames=True) as reader:
        assert reader.read(10 * len(body)) == body
    out = decompress(compressed, "zstd", 10 * len(body))
    assert out == body, f"got {len(out)} of {len(body)} bytes: frames after the first were dropped"


def test_decompress_truncated_frame_rejected():
    # BUG: a zstd frame cut short is decoded as whatever prefix was produced, with no error;
    # it must be refused (WireError) rather than passed on as a shorter body.
    data = bytes(np.random.default_rng(3).integers(0, 4, 400_000, dtype=np.uint8))
    compressed = zstandard.ZstdCompressor().compress(data)
    truncated = compressed[: len(compressed) // 2]
    assert_wire_error(lambda: decompress(truncated, "zstd", 10 * len(data)))


# ---- malformed bodies and tensors ----------------------------------------------------------------


@pytest.mark.parametrize("body", [b"\xff\xff\xff\xff", b"\x0a\xff\x01abc", b"\x1a\x05\x0a"])
def test_garbage_body(body):
    assert_wire_error(lambda: decode_forward_backward(body), "ForwardBackwardRequest")


def test_dense_bad_byte_length():
    t = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2], dense=b"\0" * 7)
    assert_wire_error(lambda: decode_with_input(t), "data[1].loss_fn_inputs.weights", "7 bytes")
    t = pb.Tensor(dtype=pb.DTYPE_INT64, shape=[1], dense=b"\0" * 4)
    assert_wire_error(lambda: decode_with_input(t, key="target_tokens"), "data[1].loss_fn_inputs.target_tokens")


def test_token_bytes_bad_length():
    msg = valid_msg()
    msg.data[0].model_input[0].encoded_text.tokens = b"\1\0\0\0\2\0"
    assert_wire_error(lambda: decode_forward_backward(msg.SerializeToString()), "data[0].model_input[0].tokens")


@pytest.mark.parametrize("shape", [[3], [2, 3], [5, 1], [0]])
def test_dense_shape_mismatch(shape):
    t = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, dense=np.zeros(4, "<f4").tobytes())
    assert_wire_error(lambda: decode_with_input(t), "data[1].loss_fn_inputs.weights", "4 values")


def test_negative_dimension():
    t = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-2, -2], dense=np.zeros(4, "<f4").tobytes())
    assert_wire_error(lambda: decode_with_input(t), "data[1].loss_fn_inputs.weights", "negative")


@pytest.mark.parametrize("dtype", [pb.DTYPE_BFLOAT16, pb.DTYPE_UNSPECIFIED, 99])
def test_unsupported_dtype(dtype):
    t = pb.Tensor(dtype=dtype, shape=[2], dense=b"\0" * 8)
    assert_wire_error(lambda: decode_with_input(t), "data[1].loss_fn_inputs.weights", "dtype")


@pytest.mark.parametrize(
    "shape,values,crow,col",
    [
        pytest.param((2, 3), [1.0], [0, 1], [0], id="crow-too-short"),
        pytest.param((2, 3), [1.0], [0, 0, 0, 1], [0], id="crow-too-long"),
        pytest.param((2, 3), [1.0], [1, 1, 1], [0], id="crow-not-starting-at-0"),
        pytest.param((2, 3), [1.0, 2.0], [0, 2, 1], [0, 1], id="crow-decreasing"),
        pytest.param((2, 3), [1.0, 2.0], [0, 1, 1], [0, 1], id="crow-end-not-nnz"),
        pytest.param((2, 3), [1.0, 2.0], [0, 1, 2], [0], id="col-count-not-nnz"),
        pytest.param((2, 3), [1.0, 2.0], [0, 1, 2], [0, 3], id="col-out-of-range"),
        pytest.param((2, 3), [1.0, 2.0], [0, 1, 2], [0, -1], id="col-negative"),
    ],
)
def test_inconsistent_csr(shape, values, crow, col):
    t = csr_tensor(shape, values, crow, col)
    assert_wire_error(lambda: decode_with_input(t), "data[1].loss_fn_inputs.weights", "CSR")


def test_csr_needs_2d_shape():
    t = csr_tensor((3,), [1.0], [0, 1], [0])
    assert_wire_error(lambda: decode_with_input(t), "data[1].loss_fn_inputs.weights", "2-D")


def test_csr_bad_byte_lengths():
    t = csr_tensor((2, 3), [1.0], [0, 1, 1], [2])
    t.sparse_csr.values = b"\0" * 5
    assert_wire_error(lambda: decode_with_input(t), "data[1].loss_fn_inputs.weights.values")
    t = csr_tensor((2, 3), [1.0], [0, 1, 1], [2])
    t.sparse_csr.crow_indices = b"\0" * 23
    assert_wire_error(lambda: decode_with_input(t), "data[1].loss_fn_inputs.weights.crow_indices")
    t = csr_tensor((2, 3), [1.0], [0, 1, 1], [2])
    t.sparse_csr.col_indices = b"\0" * 4
    assert_wire_error(lambda: decode_with_input(t), "data[1].loss_fn_inputs.weights.col_indices")


def test_csr_duplicate_column_in_a_row_rejected():
    # BUG: two values for the same (row, col) are accepted and the last one silently wins.
    # The SDK's own CSR reader (TensorData.to_torch, check_invariants=True) refuses this layout.
    t = csr_tensor((2, 3), [1.0, 2.0], [0, 2, 2], [1, 1])
    assert_wire_error(lambda: decode_with_input(t), "data[1].loss_fn_inputs.weights")


def test_dense_shape_whose_product_overflows_rejected():
    # BUG: np.prod(shape) overflows int64 to 0, the size check passes for 0 values, and
    # reshape raises a bare ValueError (→ HTTP 500, which the SDK retries) instead of WireError.
    t = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2**32, 2**32], dense=b"")
    assert_wire_error(lambda: decode_with_input(t), "data[1].loss_fn_inputs.weights")


def test_sparse_shape_too_large_rejected():
    # BUG: a CSR tensor with no entries and an absurd column count passes every index check and
    # the codec then allocates the full dense array: here numpy raises a bare ValueError
    # ("array is too big") instead of WireError; smaller absurd shapes allocate gigabytes.
    t = csr_tensor((1, 2**62), [], [0, 0], [])
    assert_wire_error(lambda: decode_with_input(t), "data[1].loss_fn_inputs.weights")


def test_image_chunk_is_decoded_for_the_layout():
    """An image chunk comes out as it came (the model's processor counts it and the server lays
    it in, or refuses it for a text-only model: ``tests/unit/server/test_images.py``)."""
    msg = valid_msg()
    chunk = msg.data[1].model_input.add()
    chunk.image.data = b"\x89PNG fake"
    chunk.image.format = "png"
    chunk.image.override_dimensions.width, chunk.image.override_dimensions.height = 30, 20
    d = decode_forward_backward(msg.SerializeToString()).datums()[1]
    assert d.chunks[-1] == WireImage(1, b"\x89PNG fake", "png", None, (30, 20))


def test_image_chunk_from_sdk_is_decoded_with_its_expected_tokens():
    mi = types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=[1, 2]),
            types.ImageChunk(data=b"\xff\xd8fake", format="jpeg", expected_tokens=4),
        ]
    )
    body = make_request_bytes([types.Datum(model_input=mi, loss_fn_inputs={})])
    (d,) = decode_forward_backward(body).datums()
    assert d.chunks[1] == WireImage(1, b"\xff\xd8fake", "jpeg", 4, None)
    assert d.tokens.tolist() == [1, 2]  # its text, until the image is laid in


def test_empty_chunk_rejected():
    msg = valid_msg()
    msg.data[0].model_input.add()
    assert_wire_error(lambda: decode_forward_backward(msg.SerializeToString()), "data[0].model_input[1]", "empty")


def test_dmel_chunk_rejected():
    msg = valid_msg()
    msg.data[0].model_input.add().dmel.dmel = b"\0\1"
    assert_wire_error(lambda: decode_forward_backward(msg.SerializeToString()), "data[0].model_input[1]", "dmel")


def test_wire_error_is_a_value_error():
    assert issubclass(WireError, ValueError)


# ---- response encoding: read back by the SDK ------------------------------------------------------


def sdk_decode(payload: bytes):
    out = deserialize_forward_backward_output(payload)
    return out, pb.ForwardBackwardOutput.FromString(payload)


def test_output_ragged_logprobs():
    rng = np.random.default_rng(4)
    arrays = [rng.normal(size=n).astype(np.float32) for n in (3, 0, 5, 1)]
    metrics = {"loss:sum": 12.5, "custom/foo:mean": -0.25}
    out, raw = sdk_decode(encode_forward_backward_output([{"logprobs": a} for a in arrays], metrics))
    assert out.loss_fn_output_type == "ArrayRecord"
    assert out.metrics == metrics
    assert len(out.loss_fn_outputs) == 4
    for got, want in zip(out.loss_fn_outputs, arrays, strict=True):
        assert set(got) == {"logprobs"}
        td = got["logprobs"]
        assert td.dtype == "float32"
        assert list(td.shape) == [len(want)]
        np.testing.assert_array_equal(td.to_numpy(), want)
    # all (N,) datums share one record
    assert len(raw.loss_fn_outputs) == 1
    assert raw.loss_fn_outputs[0].num_datums == 4


def test_output_mixed_1d_and_topk():
    rng = np.random.default_rng(5)
    shapes = [(4,), (3, 2), (6, 2), (5,), (2,), (2, 3), (0, 3)]
    arrays = [rng.normal(size=s).astype(np.float32) for s in shapes]
    out, raw = sdk_decode(encode_forward_backward_output([{"logprobs": a} for a in arrays], {"loss:sum": 1.0}))
    assert len(out.loss_fn_outputs) == len(shapes)
    for got, want in zip(out.loss_fn_outputs, arrays, strict=True):
        td = got["logprobs"]
        assert tuple(td.shape) == want.shape
        np.testing.assert_array_equal(td.to_numpy().reshape(want.shape), want)
    # one record per run of equal trailing shape: (N,) | (N,2)x2 | (N,)x2 | (N,3)x2
    assert [r.num_datums for r in raw.loss_fn_outputs] == [1, 2, 2, 2]
    assert [list(r.fields["logprobs"].trailing_shape) for r in raw.loss_fn_outputs] == [[], [2], [], [3]]
    assert sum(r.num_datums for r in raw.loss_fn_outputs) == len(shapes)


def test_output_several_fields_and_dtype_conversion():
    rng = np.random.default_rng(6)
    per_datum = []
    for n in (3, 4):
        lp64 = rng.normal(size=(n, 2))  # float64, converted to float32
        loss = np.asfortranarray(rng.normal(size=(2, n)).astype(np.float32)).T[:, :1].reshape(n)  # non-contiguous
        per_datum.append({"logprobs": lp64, "elementwise_loss": loss})
    out, raw = sdk_decode(encode_forward_backward_output(per_datum, {}))
    assert out.metrics == {}
    assert len(raw.loss_fn_outputs) == 1
    for got, want in zip(out.loss_fn_outputs, per_datum, strict=True):
        assert set(got) == {"logprobs", "elementwise_loss"}
        lp = got["logprobs"]
        assert lp.dtype == "float32" and list(lp.shape) == list(want["logprobs"].shape)
        np.testing.assert_array_equal(lp.to_numpy().reshape(lp.shape), want["logprobs"].astype(np.float32))
        el = got["elementwise_loss"]
        np.testing.assert_array_equal(el.to_numpy(), want["elementwise_loss"])


def test_output_no_datums():
    out, raw = sdk_decode(encode_forward_backward_output([], {"loss:sum": 0.0}))
    assert out.loss_fn_outputs == []
    assert out.metrics == {"loss:sum": 0.0}
    assert out.loss_fn_output_type == "ArrayRecord"


def test_output_metrics_are_double_precision():
    metrics = {"loss:sum": 1.0 / 3.0, "tokens:sum": 123456789.0, "x:max": -1e-300}
    out, _ = sdk_decode(encode_forward_backward_output([{"logprobs": np.zeros(1)}], metrics))
    assert out.metrics == metrics


def test_output_values_exact_float32():
    special = np.array([-0.0, -1e-38, -88.5, -np.inf, np.finfo(np.float32).min], dtype=np.float32)
    out, _ = sdk_decode(encode_forward_backward_output([{"logprobs": special}], {}))
    got = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert got.tobytes() == special.tobytes()


def test_sparse_tensors_are_bounded_before_allocation():
    # Rows must match the datum's positions (datum 1 has 2), columns are capped per position.
    t = csr_tensor((3, 4), [1.0], [0, 1, 1, 1], [0])
    assert_wire_error(lambda: decode_with_input(t), "data[1].loss_fn_inputs.weights", "2 positions")
    t = csr_tensor((2, 100_000), [1.0], [0, 1, 1], [0])
    assert_wire_error(lambda: decode_with_input(t), "data[1].loss_fn_inputs.weights", "values per position")
