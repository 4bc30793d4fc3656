"""The protobuf codec: ``forward_backward`` requests in; its results and ``SampleResponse`` out.

The schema is the SDK's own ``tinker.proto.tinker_public_pb2`` (protocol reference §6.9). All
arrays travel as little-endian raw bytes; tensors may be dense or sparse CSR.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import groupby

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from hosted_tinker.core.errors import UnsupportedEncoding, WireError
from hosted_tinker.core.images import ImageInput
from hosted_tinker.core.sampling import SampleOutput
from hosted_tinker.server.protocol.json_types import TensorData
from hosted_tinker.server.protocol.proto_scan import scan_forward_backward

_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
}


@dataclass(frozen=True)
class Span:
    """One run of a datum's provenance (``PromptProvenanceSpan`` / ``SampledProvenanceSpan``):
    the next ``length`` positions are positions ``[offset, offset + length)`` of the prompt
    (``sampled=False``) or of the sampled tokens (``sampled=True``) of ``sequence_id``."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class WireImage:
    """An ``ImageChunk`` as it came: ``model_input[chunk]`` of its datum."""

    chunk: int
    data: bytes
    format: str
    expected_tokens: int | None
    size: tuple[int, int] | None  # override_dimensions (width, height)


@dataclass
class WireDatum:
    tokens: np.ndarray  # int64 (N,); a datum with images: its text alone until ``serving.images`` lays them in
    loss_fn_inputs: dict[str, np.ndarray]  # dense, in the declared shape
    # Provenance (``Datum.with_provenance``): runs tiling the model input and the targets; both
    # or neither (empty lists).
    model_input_spans: list[Span] = field(default_factory=list)
    loss_fn_input_spans: list[Span] = field(default_factory=list)
    # A datum with images: its chunks in order (text tokens, or an image); empty for text alone
    chunks: list[np.ndarray | WireImage] = field(default_factory=list)
    images: list[ImageInput] = field(default_factory=list)  # where each image lies, once laid in


# Input is fed in small pieces so one piece can never inflate far past the limit (a zstd block
# of a few bytes may expand to 128 KiB: a KiB to 32 MiB), smaller ones while the start is being
# walked (64 bytes: 2 MiB at most), so that a bomb is refused before it has inflated much.
_ZSTD_PIECE = 1024
_ZSTD_FIRST_PIECE, _ZSTD_FIRST_BYTES = 64, 1 << 20
_FIRST_CHECK = 64 << 10  # the inflated size at which its start is first walked (then at each fourfold)
# Every loss_fn_input is (N,) or (N, K) with N = the datum's token count (§6.1). Dense tensors
# are bounded by the body size; sparse ones are held to N rows, K ≤ 256 columns, and a
# per-request total, so that a small body cannot make the server allocate gigabytes.
MAX_TRAILING_ELEMENTS = 256
MAX_REQUEST_ELEMENTS = 1 << 25


@dataclass
class WireForwardBackward:
    """A decoded header; the datums stay raw (where they lie in ``body``) until ``datums()``, so
    that ownership is checked before any is built, and a bad datum is reported against a known
    ``(model_id, seq_id)``."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    body: bytes | bytearray = b""
    spans: list[tuple[int, int]] = field(default_factory=list)  # each datum's (start, end) in body
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    _built: list[WireDatum] | WireError | None = None

    @property
    def num_datums(self) -> int:
        return len(self.spans)

    def build(self) -> None:
        """Decode the datums now (off the event loop) and let the body go; ``datums()`` then
        returns them, or raises what decoding them raised."""
        try:
            self._built = self._decode()
        except WireError as e:
            self._built = e
        self.body = b""

    def datums(self) -> list[WireDatum]:
        if isinstance(self._built, WireError):
            raise self._built
        return self._built if self._built is not None else self._decode()

    def _decode(self) -> list[WireDatum]:
        budget, view = [MAX_REQUEST_ELEMENTS], memoryview(self.body)
        return [_datum(_parse_datum(view[a:b], i), i, budget) for i, (a, b) in enumerate(self.spans)]


def _parse_datum(raw: bytes | memoryview, index: int) -> pb.Datum:
    try:
        return pb.Datum.FromString(raw)
    except DecodeError as e:
        raise WireError(f"data[{index}] is not a Datum protobuf: {e}") from None


def decompress(
    body: bytes,
    content_encoding: str | None,
    max_bytes: int,
    charge: Callable[[int], None] | None = None,
    check: Callable[[bytearray], None] | None = None,
) -> bytes | bytearray:
    """Undo ``Content-Encoding: zstd`` (one or more frames), refusing to inflate past
    ``max_bytes``; ``charge`` is told of each piece inflated before the next is (it raises to
    stop: the request's share of the process's memory), and ``check`` is shown what has come
    at each fourfold of its size from 64 KiB (it raises to stop: a bound the start already
    passes, ``proto_scan.check_prefix``)."""
    if not content_encoding or content_encoding.lower() == "identity":
        return body
    if content_encoding.lower() != "zstd":
        raise UnsupportedEncoding(f"Content-Encoding {content_encoding!r} is not supported (use zstd or none)")
    dctx = zstandard.ZstdDecompressor()
    out, next_check = bytearray(), _FIRST_CHECK
    view, pos = memoryview(body), 0  # an offset, not slices: slicing bytes copies the rest each time
    try:
        while pos < len(view):
            frame = dctx.decompressobj()
            while not frame.eof:
                if pos >= len(view):
                    raise WireError("zstd body is truncated: its last frame is incomplete")
                piece = view[pos : pos + (_ZSTD_FIRST_PIECE if len(out) < _ZSTD_FIRST_BYTES else _ZSTD_PIECE)]
                pos += len(piece)
                inflated = frame.decompress(piece)
                if charge is not None and inflated:
                    charge(len(inflated))
                out += inflated
                if len(out) > max_bytes:
                    raise WireError(f"decompressed body exceeds {max_bytes} bytes")
                if check is not None and len(out) >= next_check:
                    check(out)
                    next_check = 4 * len(out)
            pos -= len(frame.unused_data)  # the next frame starts inside the last piece
    except zstandard.ZstdError as e:
        raise WireError(f"body is not valid zstd: {e}") from None
    return out  # not copied into bytes: what it holds was charged once


def _frombuffer(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise WireError(f"{where}: {len(raw)} bytes is not a whole number of {dtype.name} values")
    return np.frombuffer(raw, dtype=dtype)


def decode_tensor_json(td: TensorData, where: str, leading: int, pad: float) -> tuple[np.ndarray, pb.Tensor]:
    """A JSON ``TensorData`` as a dense array (unlisted CSR cells = ``pad``) and as the protobuf
    ``Tensor`` it stands for, checked by the same rules as a protobuf one."""
    dtype = _DTYPES[pb.DTYPE_INT64 if td.dtype == "int64" else pb.DTYPE_FLOAT32]
    values = np.asarray(td.data, dtype=np.float64)
    if td.dtype == "int64" and not np.all(values == np.round(values)):
        raise WireError(f"{where}: int64 data holds a non-integer value")
    msg = pb.Tensor(dtype=pb.DTYPE_INT64 if td.dtype == "int64" else pb.DTYPE_FLOAT32, shape=td.shape or [len(values)])
    sparse = (td.sparse_crow_indices, td.sparse_col_indices)
    if (sparse[0] is None) != (sparse[1] is None):
        raise WireError(f"{where}: sparse_crow_indices and sparse_col_indices come together")
    if sparse[0] is not None:
        msg.sparse_csr.values = values.astype(dtype).tobytes()
        msg.sparse_csr.crow_indices = np.asarray(sparse[0], dtype="<i8").tobytes()
        msg.sparse_csr.col_indices = np.asarray(sparse[1], dtype="<i8").tobytes()
    else:
        msg.dense = values.astype(dtype).tobytes()
    return _tensor(msg, where, leading, [MAX_REQUEST_ELEMENTS], pad), msg


def _tensor(msg: pb.Tensor, where: str, leading: int | None, budget: list[int], pad: float = 0) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(
            f"{where}: unsupported dtype {pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype}"
        )
    shape = tuple(int(s) for s in msg.shape)
    if any(s < 0 for s in shape):
        raise WireError(f"{where}: negative dimension in shape {list(shape)}")
    if msg.HasField("sparse_csr"):
        if len(shape) != 2:
            raise WireError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
        # A few bytes of CSR can declare a huge dense shape: bound it before allocating.
        if leading is not None and shape[0] != leading:
            raise WireError(f"{where}: shape {list(shape)} does not start with the datum's {leading} positions")
        if shape[1] > MAX_TRAILING_ELEMENTS:
            raise WireError(f"{where}: shape {list(shape)} has over {MAX_TRAILING_ELEMENTS} values per position")
        budget[0] -= math.prod(shape)
        if budget[0] < 0:
            raise WireError(f"{where}: the request's sparse tensors exceed {MAX_REQUEST_ELEMENTS} values in all")
        values = _frombuffer(msg.sparse_csr.values, dtype, f"{where}.values")
        crow = _frombuffer(msg.sparse_csr.crow_indices, np.dtype("<i8"), f"{where}.crow_indices")
        col = _frombuffer(msg.sparse_csr.col_indices, np.dtype("<i8"), f"{where}.col_indices")
        rows, cols = shape
        if (
            len(crow) != rows + 1
            or crow[0] != 0
            or np.any(np.diff(crow) < 0)
            or crow[-1] != len(values)
            or len(col) != len(values)
            or (len(col) and (col.min() < 0 or col.max() >= cols))
        ):
            raise WireError(f"{where}: inconsistent CSR indices for shape {list(shape)}")
        row_of = np.repeat(np.arange(rows), np.diff(crow))
        if len(np.unique(row_of * cols + col)) != len(col):
            raise WireError(f"{where}: CSR indices name the same cell twice")
        dense = np.full(shape, pad, dtype=dtype)
        dense[row_of, col] = values
        return dense
    flat = _frombuffer(msg.dense, dtype, where)
    if not shape:
        return flat.copy()
    if math.prod(shape) != flat.size:
        raise WireError(f"{where}: {flat.size} values do not fill shape {list(shape)}")
    return flat.reshape(shape).copy()


def _datum(msg: pb.Datum, index: int, budget: list[int]) -> WireDatum:
    where = f"data[{index}]"
    chunks: list[np.ndarray | WireImage] = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            chunks.append(_frombuffer(chunk.encoded_text.tokens, np.dtype("<i4"), f"{where}.model_input[{j}].tokens"))
        elif kind == "image":
            chunks.append(_image(chunk.image, j))
        else:
            raise WireError(f"{where}.model_input[{j}]: {kind or 'empty'} chunks are not supported (text and images)")
    tokens = [c for c in chunks if isinstance(c, np.ndarray)]
    joined = np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, dtype=np.int64)
    images = [c for c in chunks if isinstance(c, WireImage)]
    # the SDK's ModelInput.length counts an image as its expected_tokens; one without them has
    # its length only once the server has counted it (``serving.images``), where shapes are checked
    expected = [i.expected_tokens for i in images]
    leading = None if None in expected else len(joined) + sum(e for e in expected if e is not None)
    inputs = {
        key: _tensor(t, f"{where}.loss_fn_inputs.{key}", leading, budget) for key, t in msg.loss_fn_inputs.items()
    }
    model_input_spans = [_span(s, f"{where}.model_input_spans[{j}]") for j, s in enumerate(msg.model_input_spans)]
    loss_fn_input_spans = [_span(s, f"{where}.loss_fn_input_spans[{j}]") for j, s in enumerate(msg.loss_fn_input_spans)]
    if bool(model_input_spans) != bool(loss_fn_input_spans):
        raise WireError(f"{where}: provenance comes as a pair: model_input_spans and loss_fn_input_spans, or neither")
    return WireDatum(joined, inputs, model_input_spans, loss_fn_input_spans, chunks if images else [])


def _image(msg: pb.ImageChunk, j: int) -> WireImage:
    size = None
    if msg.HasField("override_dimensions"):
        size = (msg.override_dimensions.width, msg.override_dimensions.height)
    expected = msg.expected_tokens if msg.HasField("expected_tokens") else None
    return WireImage(j, bytes(msg.data), msg.format, expected, size)


def _span(msg: pb.ProvenanceSpan, where: str) -> Span:
    kind = msg.WhichOneof("span")
    if kind is None:
        raise WireError(f"{where}: an empty span (neither prompt_tokens nor sampled_tokens)")
    arm = getattr(msg, kind)
    if not arm.sequence_id:
        raise WireError(f"{where}.sequence_id is empty")
    if arm.offset < 0 or arm.length < 0:
        raise WireError(f"{where}: offset {arm.offset} and length {arm.length} must be >= 0")
    return Span(kind == "sampled_tokens", arm.sequence_id, arm.offset, arm.length)


def decode_forward_backward(body: bytes | bytearray, max_tokens: int | None = None) -> WireForwardBackward:
    """The request's header, and where its datums lie, from a walk that stops at the first
    bound it passes (``proto_scan``: datums, fields, tokens) before protobuf builds anything."""
    scanned = scan_forward_backward(body, max_tokens)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(scanned.header)
    except DecodeError as e:
        raise WireError(f"body is not a ForwardBackwardRequest protobuf: {e}") from None
    # v2 carries every entry (numbers and text); the legacy map only the numeric ones.
    config: dict[str, float | str] = dict(msg.loss_fn_config.items())
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        config[key] = value.number if kind == "number" else value.text
    return WireForwardBackward(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        forward_only=msg.forward_only,
        body=body,
        spans=scanned.datums,
        loss_fn_config=config,
    )


def encode_forward_backward_output(per_datum: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """Serialise per-datum output arrays (leading dim N) and ``name:reduction`` metrics.

    Consecutive datums whose arrays share a trailing shape go into one ArrayRecord; a change
    of trailing shape (e.g. ``(N,)`` next to ``(N, K)`` logprobs) starts a new record.
    """
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        out.metrics[key] = float(value)

    def signature(d: dict[str, np.ndarray]) -> tuple:
        return tuple(sorted((k, v.shape[1:]) for k, v in d.items()))

    for _, group in groupby(per_datum, key=signature):
        datums = list(group)
        record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(datums))
        for name in datums[0]:
            arrays = [np.ascontiguousarray(d[name], dtype="<f4") for d in datums]
            offsets = np.zeros(len(arrays) + 1, dtype="<i8")
            offsets[1:] = np.cumsum([a.nbytes for a in arrays])
            bt = record.fields[name]
            bt.data = b"".join(a.tobytes() for a in arrays)
            bt.offsets = offsets.tobytes()
            bt.dtype = pb.DTYPE_FLOAT32
            bt.trailing_shape.extend(arrays[0].shape[1:])
    return out.SerializeToString()


def encode_sample_response(output: SampleOutput, target_layout: pb.Tensor | None = None) -> bytes:
    """``SampleResponse``: sequences in order, NaN-coded prompt log-probs, top-k prompt rows,
    target log-probs (in the layout of the request's ``target_layout``) and alternative draws."""
    msg = pb.SampleResponse()
    for seq in output.sequences:
        out = msg.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes(),
        )
        if seq.topk is not None:
            ids, lps = seq.topk
            out.topk_sampled_logprobs.token_ids = np.ascontiguousarray(ids, dtype="<i4").tobytes()
            out.topk_sampled_logprobs.logprobs = np.ascontiguousarray(lps, dtype="<f4").tobytes()
            out.topk_sampled_logprobs.length, out.topk_sampled_logprobs.k = ids.shape
    if output.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(output.prompt_logprobs, dtype="<f4").tobytes()
    if output.topk_prompt is not None:
        prompt_ids, prompt_lps = output.topk_prompt
        msg.topk_prompt_logprobs.token_ids = prompt_ids.numpy().astype("<i4").tobytes()
        msg.topk_prompt_logprobs.logprobs = prompt_lps.numpy().astype("<f4").tobytes()
        msg.topk_prompt_logprobs.length, msg.topk_prompt_logprobs.k = prompt_ids.shape
    if output.target_prompt is not None:
        _fill_like(msg.target_prompt_logprobs, output.target_prompt.numpy(), target_layout)
    if output.prompt_alt is not None:
        tokens, logprobs = output.prompt_alt
        _fill_like(msg.prompt_alt_tokens.tokens, tokens.numpy(), None)
        _fill_like(msg.prompt_alt_tokens.logprobs, logprobs.numpy(), None)
    return msg.SerializeToString()


def _fill_like(out: pb.Tensor, dense: np.ndarray, layout: pb.Tensor | None) -> None:
    """``dense`` as a protobuf ``Tensor``, in ``layout``'s CSR cells when that one was sparse
    (the SDK answers a sparse request in kind)."""
    dtype = pb.DTYPE_INT64 if dense.dtype.kind in "iu" else pb.DTYPE_FLOAT32
    wire = np.dtype("<i8") if dtype == pb.DTYPE_INT64 else np.dtype("<f4")
    out.dtype = dtype
    out.shape.extend(dense.shape)
    if layout is not None and layout.HasField("sparse_csr"):
        crow = np.frombuffer(layout.sparse_csr.crow_indices, dtype="<i8")
        col = np.frombuffer(layout.sparse_csr.col_indices, dtype="<i8")
        rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
        out.sparse_csr.values = dense[rows, col].astype(wire).tobytes()
        out.sparse_csr.crow_indices = layout.sparse_csr.crow_indices
        out.sparse_csr.col_indices = layout.sparse_csr.col_indices
    else:
        out.dense = dense.astype(wire).tobytes()
