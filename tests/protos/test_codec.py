"""The codec's bytes are protobuf's bytes, and arrays survive the trip unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_calls import Calls

from protos import codec
from protos import pstrain_pb2 as pb


def test_encoded_bulk_fields_are_plain_protobuf() -> None:
    keys = np.array([1, -2, 2**62], dtype=np.int64)
    msg = pb.ExchangeRequest(worker=3, pull_clock=9, pulls=[pb.ExchangePull(table="emb")])
    data = codec.encode(msg, {"payload": codec.keys_bytes(keys)})
    parsed = pb.ExchangeRequest.FromString(data)
    assert (parsed.pulls[0].table, parsed.worker, parsed.pull_clock) == ("emb", 3, 9)
    assert parsed.payload == keys.tobytes()


def test_decode_reads_what_protobuf_writes() -> None:
    values = torch.randn(5, 3)
    header = pb.ExchangeRequest(worker=2, pushes=[pb.ExchangePush(table="t", dim=3)])
    msg = pb.ExchangePart(request=header, offset=40,
                          payload=codec.tensor_bytes(values).tobytes())
    frame = codec.decode(pb.ExchangePart, msg.SerializeToString())
    assert frame.msg.request == header and frame.msg.offset == 40
    assert frame.msg.payload == b""
    back = codec.tensor_from_bytes(frame.payload("payload"), torch.float32, (5, 3))
    torch.testing.assert_close(back, values, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_tensor_round_trip(dtype: torch.dtype) -> None:
    t = torch.randn(4, 6).to(dtype)
    pulled = pb.ExchangePulled(dtype=codec.dtype_to_wire(dtype), shape=[4, 6])
    data = codec.encode(pb.ExchangeResponse(pulled=[pulled]), {"payload": codec.tensor_bytes(t)})
    frame = codec.decode(pb.ExchangeResponse, data)
    (part,) = frame.msg.pulled
    back = codec.tensor_from_bytes(
        frame.payload("payload"), codec.dtype_from_wire(part.dtype), tuple(part.shape)
    )
    assert back.dtype == dtype and torch.equal(back, t)


def test_decode_does_not_copy_bulk_fields() -> None:
    data = codec.encode(pb.ExchangeResponse(), {"payload": b"x" * 1000})
    frame = codec.decode(pb.ExchangeResponse, data)
    assert frame.payload("payload").obj is data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x7a\xff", "truncated"),
        (b"\x7a\x10abc", "past the end"),
        (b"\x0f", "wire type 7"),
    ],
)
def test_malformed_messages_are_wire_errors(data: bytes, message: str) -> None:
    with pytest.raises(codec.WireError, match=message):
        codec.decode(pb.ExchangeResponse, data)


def test_size_mismatch_names_both_sizes() -> None:
    with pytest.raises(codec.WireError, match="payload is 12 bytes but shape \\[2, 2\\]"):
        codec.tensor_from_bytes(memoryview(b"\x00" * 12), torch.float32, (2, 2))
    with pytest.raises(codec.WireError, match="not a multiple of 8"):
        codec.keys_from_bytes(memoryview(b"\x00" * 9))
    with pytest.raises(codec.WireError, match="unknown dtype code 99"):
        codec.dtype_from_wire(99)
    with pytest.raises(codec.WireError, match="cannot travel"):
        codec.dtype_to_wire(torch.complex64)


DATA = bytes(range(40))


def received(cut_every: int) -> codec.Received:
    return codec.Received([memoryview(DATA[i : i + cut_every])
                           for i in range(0, len(DATA), cut_every)])


@pytest.mark.parametrize("cut_every", [1, 3, 7, 40])
def test_a_received_payload_reads_like_its_bytes_back_to_back(cut_every: int) -> None:
    payload = received(cut_every)
    assert payload.nbytes == 40
    for offset, length in [(0, 40), (5, 11), (39, 1), (12, 0)]:
        span = pb.Span(offset=offset, length=length)
        assert bytes(payload.span(span, "x")) == DATA[offset : offset + length]
        if length % 4 == 0:
            pieces = payload.elements(span, 4, "x")
            at = 0
            for element, view in pieces:  # whole elements, in order, each byte once
                assert element * 4 == at and view.nbytes % 4 == 0
                at += view.nbytes
            assert b"".join(bytes(v) for _, v in pieces) == DATA[offset : offset + length]


def test_a_span_inside_one_buffer_is_not_copied() -> None:
    data = bytearray(DATA)
    payload = codec.Received([memoryview(data)[:20], memoryview(data)[20:]])
    view = payload.span(pb.Span(offset=4, length=8), "x")
    data[4] = 99
    assert view[0] == 99
    ((_, piece),) = payload.elements(pb.Span(offset=24, length=8), 4, "x")
    data[24] = 77
    assert piece[0] == 77


def test_spans_past_the_end_or_of_part_elements_are_wire_errors() -> None:
    payload = received(7)
    with pytest.raises(codec.WireError, match=r"keys names bytes \[36, 44\) of a 40-byte"):
        payload.span(pb.Span(offset=36, length=8), "keys")
    with pytest.raises(codec.WireError, match=r"carries 6 bytes, not a whole number of 4-byte"):
        payload.elements(pb.Span(offset=0, length=6), 4, "push")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64])
def test_tensors_become_bytes_and_back_holding_the_gil(dtype: torch.dtype) -> None:
    """No torch op (each lets go of the GIL) for the dtypes numpy holds, contiguous or not;
    bfloat16 takes a view as its int16 bits each way."""
    for t in (torch.arange(24).reshape(4, 6).to(dtype),
              torch.arange(48).reshape(4, 12).to(dtype)[:, ::2]):
        with Calls() as calls:
            back = codec.tensor_from_bytes(codec.tensor_bytes(t), dtype, (4, 6))
        assert calls.releasing() == [] and torch.equal(back, t)
    t = torch.randn(4, 6).to(torch.bfloat16)
    with Calls() as calls:
        back = codec.tensor_from_bytes(codec.tensor_bytes(t), torch.bfloat16, (4, 6))
    assert calls.releasing() == ["TensorBase.detach", "TensorBase.view", "TensorBase.view"]
    assert torch.equal(back, t)


def test_a_dtype_the_wire_does_not_carry_is_refused_both_ways() -> None:
    with pytest.raises(codec.WireError, match=r"dtype torch\.int32 cannot travel"):
        codec.tensor_bytes(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(codec.WireError, match=r"dtype torch\.int32 cannot travel"):
        codec.tensor_from_bytes(memoryview(bytes(12)), torch.int32, (3,))
