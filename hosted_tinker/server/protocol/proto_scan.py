"""A bounded walk over a ``ForwardBackwardRequest``'s wire format, before protobuf builds it.

Protobuf's parser makes an object of every message it meets, however small: 2,887 bytes of zstd
inflated to 16.8 M empty datums (32 MiB, two bytes each) took the API process past its memory
before any count could be checked. This walk reads the wire format itself, making no objects,
and stops at the first bound passed:

- how many times each repeated field occurs in one message (``REPEATS``: datums per request,
  chunks and inputs per datum, shape dimensions per tensor), and that a singular message field
  occurs once (protobuf merges repeats, which could grow its lists without a repeated field);
- how many fields the whole body holds (``MAX_FIELDS``): a body of nothing but repeated
  ``seq_id``s makes no objects, but walking it would take the CPU;
- how many tokens its datums hold (``max_tokens``), counted from each text chunk's length.

What passes is bounded by what it allows, so protobuf then parses each datum on its own, when
it is checked (``WireForwardBackward.datums``); the header (model, seq_id, loss) is read first,
so that ownership is checked before any datum is built. A zstd body is also walked as it
inflates (``check_prefix``, at each fourfold of its size): the audit's bomb stops after 64 KiB
of its 32 MiB, not after the CPU has inflated all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from tinker.proto import tinker_public_pb2 as pb

from hosted_tinker.core.errors import WireError

# The SDK sends at most 1,024 datums per request (``fwdbwd_max_chunk_len``); other clients get
# four times that.
MAX_DATUMS = 1 << 12
# In the whole body, nested ones included (an SDK datum has ~30, ~5 more per provenance span):
# the walk is Python (0.35 s for them all on a 2-core CPU), holding the GIL but for switch intervals.
MAX_FIELDS = 1 << 18
# How often a repeated field may occur in one message, by its full name; unlisted: 64.
REPEATS = {
    "tinker_public.ForwardBackwardRequest.data": MAX_DATUMS,
    "tinker_public.Datum.model_input": 256,
    "tinker_public.Datum.model_input_spans": 1 << 16,
    "tinker_public.Datum.loss_fn_input_spans": 1 << 16,
    "tinker_public.Tensor.shape": 8,
}
DEFAULT_REPEATS = 64
_TOKENS = "tinker_public.EncodedTextChunk.tokens"
_TOKEN_BYTES = 4  # little-endian int32

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_MAX_VARINT_BYTES = 10
# Scalars a packed repeated field may hold, and the fewest bytes each takes.
_NOT_SCALARS = (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
_SCALAR_BYTES = {
    FieldDescriptor.TYPE_DOUBLE: 8,
    FieldDescriptor.TYPE_FIXED64: 8,
    FieldDescriptor.TYPE_SFIXED64: 8,
    FieldDescriptor.TYPE_FLOAT: 4,
    FieldDescriptor.TYPE_FIXED32: 4,
    FieldDescriptor.TYPE_SFIXED32: 4,
}


@dataclass
class Scanned:
    """What the walk found of a request: its top-level scalar fields (the last of each, as
    protobuf keeps them), where each datum lies in the body, and the body's token count."""

    header: bytes  # the request's own fields, datums left out: parsed by protobuf, small
    datums: list[tuple[int, int]] = field(default_factory=list)  # (start, end) in the body
    tokens: int = 0


def scan_forward_backward(body: bytes | bytearray | memoryview, max_tokens: int | None = None) -> Scanned:
    """Walk ``body`` (an inflated ``ForwardBackwardRequest``) within the bounds above (tokens:
    none unless ``max_tokens``); a ``WireError`` names the first one passed, or what is malformed."""
    walk = _Walk(memoryview(body), max_tokens)
    header = bytearray()
    data = pb.ForwardBackwardRequest.DESCRIPTOR.fields_by_name["data"]
    for number, start, end, value_start in walk.fields(0, len(body), pb.ForwardBackwardRequest.DESCRIPTOR, ""):
        if number == data.number:
            walk.scanned.datums.append((value_start, end))
        else:
            header += walk.view[start:end]
    walk.scanned.header = bytes(header)
    return walk.scanned


def check_prefix(arrived: bytes | bytearray, max_tokens: int | None = None) -> None:
    """Walk what has arrived of a body (the start of its inflated form): a ``WireError`` for a
    bound already passed; nothing about its end, which is still to come."""
    view = memoryview(arrived)
    try:
        for _ in _Walk(view, max_tokens, prefix=True).fields(0, len(view), pb.ForwardBackwardRequest.DESCRIPTOR, ""):
            pass
    except _Incomplete:
        pass
    finally:
        del view  # a bytearray with a view on it cannot grow


class _Incomplete(Exception):
    """The walk of a body's start reached the end of what has arrived."""


class _Walk:
    def __init__(self, view: memoryview, max_tokens: int | None, prefix: bool = False) -> None:
        self.view = view
        self.max_tokens = max_tokens
        self.prefix = prefix  # ``view`` is a body's start: the walk ends quietly where it does
        self.arrived = len(view)
        self.fields_left = MAX_FIELDS
        self.scanned = Scanned(b"")

    def fields(self, pos: int, end: int, message: Descriptor, where: str):
        """Each field of the message in ``[pos, end)`` as ``(number, start, end, value_start)``,
        checked (and nested messages walked) before it is yielded."""
        seen: dict[int, int] = {}
        while pos < end:
            start = pos
            tag, pos = self._varint(pos, end, where)
            number, wire = tag >> 3, tag & 7
            self.fields_left -= 1
            if self.fields_left < 0:
                raise WireError(f"the body holds over {MAX_FIELDS} protobuf fields")
            desc = message.fields_by_number.get(number)
            name = desc.name if desc is not None else f"<field {number}>"
            name = f"{where}.{name}" if where else name
            value_start, pos = self._skip(pos, end, wire, name)
            here = min(pos, self.arrived)  # a body's start: what has arrived of this value
            if desc is not None:  # unknown: protobuf keeps it as bytes, bounded by the body
                seen[number] = count = seen.get(number, 0) + self._values(desc, wire, value_start, here)
                self._check(desc, wire, count, value_start, here, name)
            if pos > self.arrived:
                raise _Incomplete
            if desc is not None:
                yield number, start, pos, value_start

    def _values(self, desc: FieldDescriptor, wire: int, start: int, end: int) -> int:
        """How many values one occurrence of a field adds: one, or a packed run's count (its
        varints counted by their last bytes once the run is short enough to hold its bound)."""
        if not (wire == _LEN and desc.is_repeated and desc.type not in _NOT_SCALARS):
            return 1
        if (size := _SCALAR_BYTES.get(desc.type)) is not None:
            return (end - start) // size
        bound = REPEATS.get(desc.full_name, DEFAULT_REPEATS)
        if end - start > _MAX_VARINT_BYTES * bound:
            return bound + 1
        return sum(1 for byte in self.view[start:end] if byte < 0x80)

    def _check(self, desc: FieldDescriptor, wire: int, count: int, start: int, end: int, name: str) -> None:
        """``count``: the field's values so far in this message, this occurrence's included."""
        repeated = desc.is_repeated
        bound = REPEATS.get(desc.full_name, DEFAULT_REPEATS)
        if repeated and count > bound:
            raise WireError(f"{name}: over {bound} values in one {desc.containing_type.name}")
        if desc.type == FieldDescriptor.TYPE_MESSAGE:
            if wire != _LEN:
                raise _malformed(f"{name}: a message sent as wire type {wire}")
            if not repeated and count > 1:
                raise WireError(f"{name} occurs {count} times; it is a single message")
            for _ in self.fields(start, end, desc.message_type, f"{name}[{count - 1}]" if repeated else name):
                pass
        elif desc.full_name == _TOKENS:
            self.scanned.tokens += (end - start) // _TOKEN_BYTES
            if self.max_tokens is not None and self.scanned.tokens > self.max_tokens:
                raise WireError(f"{name}: the request holds over {self.max_tokens} tokens, the limit per request")

    def _skip(self, pos: int, end: int, wire: int, where: str) -> tuple[int, int]:
        """Past one field's value: ``(value_start, value_end)``."""
        if wire == _VARINT:
            return pos, self._varint(pos, end, where)[1]
        if wire in (_I64, _I32):
            size = 8 if wire == _I64 else 4
        elif wire == _LEN:
            size, pos = self._varint(pos, end, where)
        else:
            raise _malformed(f"{where}: wire type {wire}")
        if pos + size > end and not (self.prefix and end >= self.arrived):
            raise _malformed(f"{where}: truncated: {size} bytes declared, {end - pos} left")
        return pos, pos + size

    def _varint(self, pos: int, end: int, where: str) -> tuple[int, int]:
        view, value, shift = self.view, 0, 0
        while pos < end and shift < 64:
            byte = view[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, pos
            shift += 7
        if self.prefix and pos >= self.arrived:
            raise _Incomplete
        raise _malformed(f"{where or 'a field tag'}: a truncated or overlong varint")


def _malformed(detail: str) -> WireError:
    return WireError(f"body is not a ForwardBackwardRequest protobuf: {detail}")
