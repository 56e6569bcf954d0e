"""The codec's bytes are protobuf's bytes, and arrays survive the trip unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protos import codec
from protos import pstrain_pb2 as pb


def test_encoded_bulk_fields_are_plain_protobuf() -> None:
    keys = np.array([1, -2, 2**62], dtype=np.int64)
    msg = pb.PullSparseRequest(table="emb", worker=3, clock=9)
    data = codec.encode(msg, {"keys": codec.keys_bytes(keys)})
    parsed = pb.PullSparseRequest.FromString(data)
    assert (parsed.table, parsed.worker, parsed.clock) == ("emb", 3, 9)
    assert parsed.keys == keys.tobytes()


def test_decode_reads_what_protobuf_writes() -> None:
    values = torch.randn(5, 3)
    header = pb.PushSparseHeader(table="t", dim=3, dtype=pb.FLOAT32)
    msg = pb.PushSparseChunk(header=header, keys=b"\x01" * 40,
                             values=codec.tensor_bytes(values).tobytes())
    frame = codec.decode(pb.PushSparseChunk, msg.SerializeToString())
    assert frame.msg.header == header
    assert frame.msg.keys == b"" and frame.payload("keys").tobytes() == b"\x01" * 40
    back = codec.tensor_from_bytes(frame.payload("values"), torch.float32, (5, 3))
    torch.testing.assert_close(back, values, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_tensor_round_trip(dtype: torch.dtype) -> None:
    t = torch.randn(4, 6).to(dtype)
    data = codec.encode(pb.DenseChunk(dtype=codec.dtype_to_wire(dtype), shape=[4, 6]),
                        {"data": codec.tensor_bytes(t)})
    frame = codec.decode(pb.DenseChunk, data)
    back = codec.tensor_from_bytes(
        frame.payload("data"), codec.dtype_from_wire(frame.msg.dtype), tuple(frame.msg.shape)
    )
    assert back.dtype == dtype and torch.equal(back, t)


def test_decode_does_not_copy_bulk_fields() -> None:
    data = codec.encode(pb.DenseChunk(), {"data": b"x" * 1000})
    frame = codec.decode(pb.DenseChunk, data)
    assert frame.payload("data").obj is data


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
        codec.decode(pb.DenseChunk, data)


def test_size_mismatch_names_both_sizes() -> None:
    with pytest.raises(codec.WireError, match="payload is 12 bytes but shape \\[2, 2\\]"):
        codec.tensor_from_bytes(memoryview(b"\x00" * 12), torch.float32, (2, 2))
    with pytest.raises(codec.WireError, match="not a multiple of 8"):
        codec.keys_from_bytes(memoryview(b"\x00" * 9))
    with pytest.raises(codec.WireError, match="unknown dtype code 99"):
        codec.dtype_from_wire(99)
    with pytest.raises(codec.WireError, match="cannot travel"):
        codec.dtype_to_wire(torch.complex64)
