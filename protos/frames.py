"""Messages with bulk fields: the framing half of the wire codec, with no torch in it.

A message travels as ordinary protobuf bytes, but its bulk fields (the `bytes` fields that
carry keys, values and gradients) are written and read here rather than by protobuf: the
encoder appends them after the serialized header with one copy, and the decoder returns them
as `memoryview` slices of the received buffer, with no copy at all. The bytes are identical to
what protobuf would write for the same message, so any protobuf implementation can talk to a
pstrain server; only the Python cost differs (protobuf copies a 16 MiB field several times).

It imports no torch, so the CLI's admin and health calls start in a fraction of a second;
`protos.codec` adds the arrays and re-exports everything here.
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from typing_extensions import Buffer

from protos import pstrain_pb2 as pb

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("pstrain's wire format is little-endian; this host is big-endian")

M = TypeVar("M", bound=Message)

_WIRE_VARINT = 0
_WIRE_FIXED64 = 1
_WIRE_LEN = 2
_WIRE_FIXED32 = 5


class WireError(ValueError):
    """A message or array on the wire is malformed; the message says what was wrong."""


@dataclass(frozen=True)
class Frame(Generic[M]):
    """A decoded message: its header fields, and its bulk fields as views of the buffer."""

    msg: M
    bulk: Mapping[str, memoryview]

    def payload(self, name: str) -> memoryview:
        """The bulk field `name`, empty when the sender left it out."""
        return self.bulk.get(name, _EMPTY)


_EMPTY = memoryview(b"")
# decode() first tries protobuf's parser on messages up to this size.
_PARSE_FIRST_BYTES = 4096
_bulk_fields_cache: dict[type[Message], dict[int, str]] = {}


def _bulk_fields(cls: type[Message]) -> dict[int, str]:
    """Field number -> name of the top-level `bytes` fields of a message class."""
    found = _bulk_fields_cache.get(cls)
    if found is None:
        found = {
            f.number: f.name
            for f in cls.DESCRIPTOR.fields
            if f.type == FieldDescriptor.TYPE_BYTES and not _is_repeated(f)
        }
        _bulk_fields_cache[cls] = found
    return found


def _is_repeated(field: Any) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 6 dropped `label`
        return bool(field.is_repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    end = len(buf)
    while True:
        if pos >= end or shift > 63:
            raise WireError("truncated or overlong varint in message")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def encode(
    msg: Message, bulk: Mapping[str, Buffer | Sequence[Buffer]] | None = None
) -> bytes:
    """Serialize `msg` followed by its bulk fields; copies each bulk buffer once.

    `bulk` maps names of top-level `bytes` fields of `msg` to buffers (numpy arrays, tensors'
    numpy views, memoryviews), or to a list of buffers that the field carries back to back.
    Those fields must not also be set on `msg` itself.
    """
    head = msg.SerializeToString()
    if not bulk:
        return head
    numbers = {name: number for number, name in _bulk_fields(type(msg)).items()}
    parts: list[Buffer] = [head]
    for name, buf in bulk.items():
        number = numbers.get(name)
        if number is None:
            raise WireError(f"{type(msg).__name__} has no bytes field named {name!r}")
        buffers = list(buf) if isinstance(buf, list | tuple) else [cast(Buffer, buf)]
        views = [memoryview(b).cast("B") for b in buffers]
        parts.append(_varint(number << 3 | _WIRE_LEN))
        parts.append(_varint(sum(v.nbytes for v in views)))
        parts.extend(views)
    return b"".join(parts)


def decode(cls: type[M], data: bytes) -> Frame[M]:
    """Parse `data` as a `cls` message; bulk fields come back as views into `data`.

    Raises WireError on malformed input. Does not block; thread-safe.
    """
    bulk_numbers = _bulk_fields(cls)
    if len(data) <= _PARSE_FIRST_BYTES:
        # Most small messages carry no bulk field (their bulk data travels by a transport):
        # protobuf's own parser is then the whole job, ten times faster than the walk below.
        try:
            parsed = cls.FromString(data)
        except DecodeError:
            parsed = None  # the walk below says what is wrong
        if parsed is not None and not any(getattr(parsed, name)
                                          for name in bulk_numbers.values()):
            return Frame(parsed, {})
    view = memoryview(data)
    head_parts: list[memoryview] = []
    bulk: dict[str, memoryview] = {}
    plain_start = 0
    pos = 0
    end = len(view)
    while pos < end:
        field_start = pos
        tag, pos = _read_varint(view, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _WIRE_LEN:
            length, pos = _read_varint(view, pos)
            if pos + length > end:
                raise WireError(f"field {number} claims {length} bytes past the end of the message")
            name = bulk_numbers.get(number)
            if name is not None:
                if field_start > plain_start:
                    head_parts.append(view[plain_start:field_start])
                bulk[name] = view[pos : pos + length]
                plain_start = pos + length
            pos += length
        elif wire_type == _WIRE_VARINT:
            _, pos = _read_varint(view, pos)
        elif wire_type == _WIRE_FIXED64:
            pos += 8
        elif wire_type == _WIRE_FIXED32:
            pos += 4
        else:
            raise WireError(f"unsupported protobuf wire type {wire_type} for field {number}")
    if pos != end:
        raise WireError("message ends inside a fixed-width field")
    if plain_start < end:
        head_parts.append(view[plain_start:end])
    try:
        msg = cls.FromString(b"".join(head_parts) if bulk else data)
    except DecodeError as exc:
        raise WireError(f"cannot parse {cls.__name__}: {exc}") from exc
    return Frame(msg, bulk)


class Payload:
    """Bulk parts laid back to back in one `bytes` field, each named by a Span.

    `add` keeps a view of each part (no copy); `encode(msg, {field: payload.parts})` copies
    them once into the message. Not thread-safe.
    """

    def __init__(self) -> None:
        self.parts: list[memoryview] = []
        self.nbytes = 0

    def add(self, buf: Buffer) -> pb.Span:
        view = memoryview(buf).cast("B")
        span = pb.Span(offset=self.nbytes, length=view.nbytes)
        self.parts.append(view)
        self.nbytes += view.nbytes
        return span

    def copy_into(self, view: memoryview) -> None:
        """Writes the parts back to back at the start of `view` (at least `nbytes` long)."""
        pos = 0
        for part in self.parts:
            view[pos : pos + part.nbytes] = part
            pos += part.nbytes


class Received:
    """A received payload held as the buffers it arrived in, back to back: the parts of a
    streamed request are not copied into one buffer (a reader that wants one has a Joiner
    assemble it as the parts arrive). Read-only; never copied whole."""

    def __init__(self, buffers: Sequence[memoryview]) -> None:
        self.buffers = [b for b in buffers if b.nbytes]
        self.starts: list[int] = []
        self.nbytes = 0
        for b in self.buffers:
            self.starts.append(self.nbytes)
            self.nbytes += b.nbytes

    def _check(self, span: pb.Span, what: str) -> int:
        end = span.offset + span.length
        if end > self.nbytes:
            raise WireError(
                f"{what} names bytes [{span.offset}, {end}) of a {self.nbytes}-byte payload"
            )
        return end

    def span(self, span: pb.Span, what: str) -> memoryview:
        """The bytes `span` names, as one view: a copy only when they cross buffers;
        WireError when the span reaches past the end."""
        end = self._check(span, what)
        if len(self.buffers) == 1:  # a payload that arrived whole: most of them
            return self.buffers[0][span.offset : end]
        pieces = [view for _, view in self._cover(span.offset, end)]
        if len(pieces) == 1:
            return pieces[0]
        return memoryview(b"".join(pieces))

    def elements(self, span: pb.Span, itemsize: int, what: str) -> list[tuple[int, memoryview]]:
        """The bytes `span` names as (element offset, view) pieces in order, each a whole
        number of `itemsize`-byte elements; only an element cut between two buffers is
        copied. WireError when the span reaches past the end or is not whole elements."""
        end = self._check(span, what)
        if span.length % itemsize:
            raise WireError(f"{what} carries {span.length} bytes, not a whole number of "
                            f"{itemsize}-byte elements")
        out: list[tuple[int, memoryview]] = []
        carry = b""  # the head of an element cut at the end of the previous buffer
        for start, piece in self._cover(span.offset, end):
            at, view = start - span.offset, piece
            if carry:
                need = itemsize - len(carry)
                carry += bytes(view[:need])
                if len(carry) < itemsize:
                    continue
                out.append(((at + need) // itemsize - 1, memoryview(carry)))
                at, view, carry = at + need, view[need:], b""
            whole = view.nbytes - view.nbytes % itemsize
            if whole:
                out.append((at // itemsize, view[:whole]))
            carry = bytes(view[whole:])
        return out

    def _cover(self, begin: int, end: int) -> list[tuple[int, memoryview]]:
        """(payload offset, view) of the buffers' bytes in [begin, end), in order."""
        out = []
        i = max(0, bisect.bisect_right(self.starts, begin) - 1)
        while i < len(self.buffers) and self.starts[i] < end:
            at, b = self.starts[i], self.buffers[i]
            lo, hi = max(begin, at), min(end, at + b.nbytes)
            if hi > lo:
                out.append((lo, b[lo - at : hi - at]))
            i += 1
        return out
