"""ExchangeStream's framing: a message and its payload cut into parts, and joined again.

The first part carries the message (with an empty payload) and the payload's total size;
every part carries the next bytes of the payload, at the offset it names. `Joiner` takes
the parts as they arrive and hands back the message and its payload (the parts' own
buffers, not copied; or, assembled, one buffer each part was copied into as it arrived)
only when exactly the announced bytes have arrived in order, so a stream that ends early
is refused whole. Both ends use this for both directions
(ExchangePart, ExchangeAnswerPart). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import numpy as np
from google.protobuf.message import Message

from protos import pstrain_pb2 as pb
from protos.frames import Frame, Received, WireError, encode

Part = TypeVar("Part", pb.ExchangePart, pb.ExchangeAnswerPart)
M = TypeVar("M", bound=Message)


def _head_field(cls: type[Message]) -> str:
    return "request" if cls is pb.ExchangePart else "response"


def cut(cls: type[Part], head: Message, payload: Sequence[memoryview], nbytes: int,
        chunk_bytes: int) -> Iterator[bytes]:
    """Encoded parts carrying `head` and the `nbytes` bytes of `payload` (its buffers back
    to back), at most `chunk_bytes` of payload in each. Copies each byte once, lazily."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    msg = cls(payload_bytes=nbytes)
    getattr(msg, _head_field(cls)).CopyFrom(head)
    pieces: list[memoryview] = []
    size = offset = 0
    first = True
    for buf in payload:
        pos = 0
        while pos < buf.nbytes:
            take = min(chunk_bytes - size, buf.nbytes - pos)
            pieces.append(buf[pos : pos + take])
            size += take
            pos += take
            if size == chunk_bytes:
                yield encode(msg, {"payload": pieces})
                first = False
                offset += size
                msg = cls(offset=offset)
                pieces, size = [], 0
    if size or first:
        yield encode(msg, {"payload": pieces})


class Joiner(Generic[Part, M]):
    """Joins the parts of one stream. Not thread-safe: one stream, one reader.

    `check_head(head, nbytes)` sees the message and the announced size on the first part,
    before any payload is held, and raises to refuse them. With `assemble`, each part is
    copied into one writable buffer as it arrives, while the next one travels, for a reader
    that wants the payload in one piece (a copy of the whole after the last part would
    wait for it).
    """

    def __init__(self, first: Frame[Part], check_head: Callable[[Message, int], None],
                 what: str, assemble: bool = False) -> None:
        field = _head_field(type(first.msg))
        if not first.msg.HasField(field):  # type: ignore[arg-type]
            raise WireError(f"{what}: the first part of a stream must carry the {field}")
        self.head = getattr(first.msg, field)
        self.nbytes = int(first.msg.payload_bytes)
        self.what = what
        check_head(self.head, self.nbytes)
        self._buffers: list[memoryview] = []
        # Uninitialised (every byte is written before it is read): numpy backs a large
        # buffer with huge pages, where a zeroed bytearray faults in every 4 KiB page.
        self._whole = np.empty(self.nbytes, np.uint8).data if assemble else None
        self._received = 0
        self.add(first)

    def add(self, part: Frame[Part]) -> None:
        """Takes the next part; WireError when it is out of order or past the total."""
        data = part.payload("payload")
        if part.msg.offset != self._received:
            raise WireError(
                f"{self.what}: a part at byte {part.msg.offset} does not follow the "
                f"{self._received} bytes received so far"
            )
        end = self._received + data.nbytes
        if end > self.nbytes:
            raise WireError(
                f"{self.what}: parts carry more than the {self.nbytes} bytes announced"
            )
        if self._whole is None:
            self._buffers.append(data)
        else:
            self._whole[self._received : end] = data
        self._received = end

    def finish(self) -> tuple[M, Received]:
        """The message and its whole payload; WireError when bytes are missing."""
        if self._received != self.nbytes:
            raise WireError(
                f"{self.what}: the stream ended after {self._received} of the "
                f"{self.nbytes} bytes announced; nothing of it was applied"
            )
        head: M = self.head
        return head, Received(self._buffers if self._whole is None else [self._whole])


def join(parts: Iterator[Frame[Part]], check_head: Callable[[Message, int], None],
         what: str, assemble: bool = False) -> tuple[Message, Received]:
    """The message and payload of a whole stream of parts (see Joiner)."""
    first = next(parts, None)
    if first is None:
        raise WireError(f"{what}: the stream ended before its first part")
    joiner: Joiner[Part, Message] = Joiner(first, check_head, what, assemble)
    for part in parts:
        joiner.add(part)
    return joiner.finish()
