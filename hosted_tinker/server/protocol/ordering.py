"""A request's place in its model's line, read from the first bytes of its body.

An ordered request (one that names ``model_id`` and ``seq_id``) that is refused before its body
is parsed, because the body is too large, will not inflate, or is not the protobuf it should be,
must still use up its ``seq_id``: the SDK has numbered the model's later requests after it, and
they would wait for it forever. The SDK sends the two fields first (pydantic's field order puts
them ahead of anything large in the JSON requests; protobuf writes fields in number order, and
they are fields 1 and 2 of ``ForwardBackwardRequest``), so a bounded head of the body carries
them. A body that puts them after a large value is refused without them, as before.
"""

from __future__ import annotations

import io
import json

import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from hosted_tinker.server.protocol.strict import is_text

HEAD_BYTES = 64 << 10  # of the body as sent, and of its inflated form
# A zstd frame inflates block by block (up to 128 KiB each), so the compressed head must hold a
# whole first block before any byte of the request comes out of it.
ENCODED_HEAD_BYTES = 256 << 10

_WHITESPACE = " \t\r\n"


def head_limit(content_encoding: str | None) -> int:
    """How many bytes of a body to keep for :func:`order_of`."""
    return ENCODED_HEAD_BYTES if _is_zstd(content_encoding) else HEAD_BYTES


def order_of(head: bytes, content_type: str, content_encoding: str | None = None) -> tuple[str, int] | None:
    """``(model_id, seq_id)`` from the head of a request body (the whole body, or its first
    :func:`head_limit` bytes), or None when that head does not carry both."""
    if _is_zstd(content_encoding):
        try:
            head = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(head)).read(HEAD_BYTES)
        except zstandard.ZstdError:
            return None
    head = head[:HEAD_BYTES]
    order = _protobuf_order(head) if "protobuf" in content_type else _json_order(head)
    if order is not None and not is_text(order[0]):
        return None  # a lone surrogate escaped in JSON names no model, and no query may carry it
    return order


def _is_zstd(content_encoding: str | None) -> bool:
    return (content_encoding or "").strip().lower() == "zstd"


# ---- protobuf -------------------------------------------------------------------------------


def _protobuf_order(head: bytes) -> tuple[str, int] | None:
    """Parse the leading ``model_id`` and ``seq_id`` fields of ``head`` as a message of their
    own: protobuf decodes a message from any run of whole fields."""
    try:
        msg = pb.ForwardBackwardRequest.FromString(head[: _leading_fields(head, _ORDER_FIELDS)])
    except DecodeError:
        return None
    return (msg.model_id, msg.seq_id) if msg.model_id else None


_ORDER_FIELDS = (
    pb.ForwardBackwardRequest.MODEL_ID_FIELD_NUMBER,
    pb.ForwardBackwardRequest.SEQ_ID_FIELD_NUMBER,
)


def _leading_fields(buf: bytes, numbers: tuple[int, ...]) -> int:
    """The length of the run of whole fields numbered ``numbers`` at the start of ``buf``."""
    pos = end = 0
    try:
        while pos < len(buf):
            tag, pos = _varint(buf, pos)
            if tag >> 3 not in numbers:
                break
            wire_type = tag & 7
            if wire_type == 0:
                _, pos = _varint(buf, pos)
            elif wire_type == 2:
                size, pos = _varint(buf, pos)
                pos += size
            else:  # not how a string or an int32 is written
                break
            if pos > len(buf):
                break
            end = pos
    except IndexError:  # the head ends inside a varint
        pass
    return end


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise IndexError("varint longer than 10 bytes")


# ---- JSON -----------------------------------------------------------------------------------


def _json_order(head: bytes) -> tuple[str, int] | None:
    """Read the top-level members of a JSON object one value at a time with the standard
    decoder, until both fields are found or a value runs past the head."""
    text = head.decode("utf-8", "replace")  # only a character cut at the very end is replaced
    decoder = json.JSONDecoder()
    members: dict[str, object] = {}
    pos = _skip(text, 0)
    if not text.startswith("{", pos):
        return None
    pos += 1
    try:
        while not ("model_id" in members and "seq_id" in members):
            key, pos = decoder.raw_decode(text, _skip(text, pos))
            pos = _skip(text, pos)
            if not isinstance(key, str) or not text.startswith(":", pos):
                break
            value, pos = decoder.raw_decode(text, _skip(text, pos + 1))
            pos = _skip(text, pos)
            if not text.startswith((",", "}"), pos):  # a number the head cuts might go on: 3 of 31
                break
            members[key] = value
            if text.startswith("}", pos):
                break
            pos += 1
    except ValueError:  # a value cut off by the end of the head, or not JSON
        pass
    model_id, seq_id = members.get("model_id"), members.get("seq_id")
    if isinstance(model_id, str) and type(seq_id) is int:
        return model_id, seq_id
    return None


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos
