"""ExchangeStream's framing: parts carry every byte once, in order, and a stream that is cut,
reordered or over its size is refused whole."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from protos import codec
from protos import pstrain_pb2 as pb
from protos.parts import cut, join

HEAD = pb.ExchangeRequest(worker=4, push_clock=7, pulls=[pb.ExchangePull(table="w", dense=True)])


def _parts(buffers: list[bytes], chunk_bytes: int) -> list[codec.Frame[pb.ExchangePart]]:
    views = [memoryview(b) for b in buffers]
    total = sum(len(b) for b in buffers)
    return [codec.decode(pb.ExchangePart, p)
            for p in cut(pb.ExchangePart, HEAD, views, total, chunk_bytes)]


def _accept(head: object, nbytes: int) -> None:
    del head, nbytes


def _bytes(payload: codec.Received) -> bytes:
    return b"".join(bytes(b) for b in payload.buffers)


@pytest.mark.parametrize(
    ("buffers", "chunk_bytes", "sizes"),
    [
        ([b"abcdefgh"], 3, [3, 3, 2]),
        ([b"ab", b"cdefg", b"", b"h"], 3, [3, 3, 2]),  # parts span buffers
        ([b"abcdef"], 3, [3, 3]),  # an exact multiple: no empty last part
        ([b"abc"], 1 << 20, [3]),
        ([], 4, [0]),  # nothing to carry: one part with the request
        ([b""], 4, [0]),
    ],
)
def test_parts_carry_every_byte_once_in_order(
    buffers: list[bytes], chunk_bytes: int, sizes: list[int]
) -> None:
    parts = _parts(buffers, chunk_bytes)
    assert [p.payload("payload").nbytes for p in parts] == sizes
    assert [p.msg.HasField("request") for p in parts] == [True] + [False] * (len(parts) - 1)
    assert parts[0].msg.payload_bytes == sum(sizes)
    offsets = [p.msg.offset for p in parts]
    assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]
    head, payload = join(iter(parts), _accept, "test")
    assert head == HEAD and _bytes(payload) == b"".join(buffers)
    head, payload = join(iter(parts), _accept, "test", assemble=True)
    assert head == HEAD and _bytes(payload) == b"".join(buffers)
    assert len(payload.buffers) == (1 if sum(sizes) else 0)  # one piece (none when empty)
    assert not any(b.readonly for b in payload.buffers)  # the reader's own, kept as a tensor


@pytest.mark.parametrize("assemble", [False, True])
def test_a_stream_cut_at_any_part_is_refused(assemble: bool) -> None:
    parts = _parts([bytes(range(100))], 16)
    for keep in range(1, len(parts)):
        with pytest.raises(codec.WireError, match=f"ended after {16 * keep} of the 100 bytes"):
            join(iter(parts[:keep]), _accept, "test", assemble)


def test_parts_out_of_order_or_past_the_total_are_refused() -> None:
    parts = _parts([bytes(range(40))], 16)
    with pytest.raises(codec.WireError, match="a part at byte 32 does not follow the 16 bytes"):
        join(iter([parts[0], parts[2], parts[1]]), _accept, "test")
    with pytest.raises(codec.WireError, match="more than the 40 bytes announced"):
        extra = codec.decode(pb.ExchangePart, codec.encode(pb.ExchangePart(offset=40),
                                                           {"payload": b"x"}))
        join(iter([*parts, extra]), _accept, "test")
    with pytest.raises(codec.WireError, match="first part of a stream must carry the request"):
        join(iter(parts[1:]), _accept, "test")
    with pytest.raises(codec.WireError, match="ended before its first part"):
        join(iter([]), _accept, "test")


@pytest.mark.parametrize("assemble", [False, True])
def test_the_head_and_size_are_checked_before_any_payload_is_held(assemble: bool) -> None:
    seen: list[tuple[object, int]] = []

    def refuse(head: object, nbytes: int) -> None:
        seen.append((head, nbytes))
        raise OverflowError(f"{nbytes} is too many")

    def parts() -> Iterator[codec.Frame[pb.ExchangePart]]:
        yield codec.decode(pb.ExchangePart, codec.encode(
            pb.ExchangePart(request=HEAD, payload_bytes=1 << 50)))
        raise AssertionError("read past a refused first part")

    with pytest.raises(OverflowError, match="too many"):  # not MemoryError: nothing made yet
        join(parts(), refuse, "test", assemble)
    assert seen == [(HEAD, 1 << 50)]


def test_answers_are_cut_and_joined_the_same_way() -> None:
    response = pb.ExchangeResponse(open_clock=3)
    data = [codec.decode(pb.ExchangeAnswerPart, p) for p in
            cut(pb.ExchangeAnswerPart, response, [memoryview(b"x" * 10)], 10, 4)]
    head, payload = join(iter(data), _accept, "test")
    assert head == response and _bytes(payload) == b"x" * 10
    assert [b.nbytes for b in payload.buffers] == [4, 4, 2]  # the parts themselves, uncopied
