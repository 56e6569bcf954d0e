"""The codec's bytes are protobuf's bytes, and arrays survive the trip unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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
