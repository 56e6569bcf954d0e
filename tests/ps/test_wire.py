"""ps.wire: wire messages to domain values and back, with no server (pure)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protos import codec, modes
from protos import pstrain_pb2 as pb
from protos.codec import WireError
from ps import wire
from ps.errors import InvalidArgumentError
from ps.shard import (
    ClockState,
    DensePush,
    Exchange,
    ExchangeResult,
    Pull,
    PushMeta,
    PushOutcome,
    SparsePush,
)


def request(*parts: bytes, cut_every: int = 0
            ) -> tuple[pb.ExchangeRequest, codec.Received, list[pb.Span]]:
    """A request header, its payload (in buffers of `cut_every` bytes, as a stream's parts
    arrive, or one buffer), and the span of each part."""
    payload = codec.Payload()
    spans = [payload.add(p) for p in parts]
    data = b"".join(bytes(p) for p in payload.parts)
    step = cut_every or max(1, len(data))
    buffers = [memoryview(data[i : i + step]) for i in range(0, len(data), step)]
    return pb.ExchangeRequest(worker=3, incarnation=9, generation=2, push_clock=5,
                              pull_clock=6, wait_ms=1500), codec.Received(buffers), spans


def whole(push: DensePush) -> torch.Tensor:
    """A dense push's parts put back together, checking they cover the block once in order."""
    at = 0
    for offset, part in push.parts:
        assert offset == at
        at += part.numel()
    return torch.cat([part for _, part in push.parts]) if push.parts else torch.empty(0)


# The dense push's 16 bytes start at byte 50, off a 4-byte boundary; buffers of `cut_every`
# bytes cut its elements in different places, and the pieces follow the buffers.
@pytest.mark.parametrize(("cut_every", "pieces"), [(0, 1), (1, 4), (3, 4), (5, 4), (16, 2)])
def test_an_exchange_becomes_its_domain_values(cut_every: int, pieces: int) -> None:
    keys = np.array([4, -1, 2**40], dtype="<i8")
    rows = torch.arange(6, dtype=torch.float32)
    dense = torch.arange(4, dtype=torch.float32)
    msg, payload, (k, v, _, d, pk) = request(
        keys.tobytes(), codec.tensor_bytes(rows), bytes(2), codec.tensor_bytes(dense),
        keys[:2].tobytes(), cut_every=cut_every)
    msg.pushes.add(table="e", seq=7, dtype=pb.FLOAT32, dim=2, keys=k, values=v)
    msg.pushes.add(table="w", seq=8, dtype=pb.FLOAT32, shape=[2, 2], values=d, dense=True,
                   assign=True, if_absent=True)
    msg.end_iteration = True
    msg.pulls.add(table="w", dense=True)
    msg.pulls.add(table="e", keys=pk)
    ex = wire.exchange_from_proto(msg, payload)
    assert (ex.worker, ex.incarnation, ex.generation, ex.push_clock, ex.pull_clock) == (
        3, 9, 2, 5, 6)
    assert ex.end_iteration and ex.wait_s == 1.5
    sparse, dense_push = ex.pushes
    assert isinstance(sparse, SparsePush) and isinstance(dense_push, DensePush)
    assert sparse.meta == PushMeta(3, 9, 7, clock=5, wait_s=1.5, generation=2)
    assert sparse.keys.tolist() == keys.tolist() and sparse.dim == 2
    assert bytes(sparse.values) == codec.tensor_bytes(rows).tobytes()
    assert dense_push.meta.assign and dense_push.meta.if_absent
    assert dense_push.shape == (2, 2) and torch.equal(whole(dense_push), dense)
    assert len(dense_push.parts) == pieces
    assert ex.pulls[0] == Pull("w")
    assert ex.pulls[1].keys is not None and ex.pulls[1].keys.tolist() == [4, -1]


def test_a_dense_push_whose_bytes_do_not_fill_its_shape_is_refused() -> None:
    msg, payload, (v,) = request(codec.tensor_bytes(torch.ones(3)))
    msg.pushes.add(table="w", seq=1, dtype=pb.FLOAT32, shape=[2, 2], values=v, dense=True)
    with pytest.raises(InvalidArgumentError, match=r"carries 12 bytes but shape \[2, 2\] of "
                                                   r"float32 needs 16"):
        wire.exchange_from_proto(msg, payload)


def test_spans_past_the_payload_and_odd_key_bytes_are_wire_errors() -> None:
    msg, payload, _ = request(b"12345678")
    msg.pulls.add(table="e", keys=pb.Span(offset=4, length=8))
    with pytest.raises(WireError, match=r"pull of 'e' names bytes \[4, 12\) of a 8-byte"):
        wire.exchange_from_proto(msg, payload)
    msg, payload, (k,) = request(b"123456")
    msg.pulls.add(table="e", keys=k)
    with pytest.raises(WireError, match="not a multiple of 8"):
        wire.exchange_from_proto(msg, payload)


def test_answers_carry_each_outcome_and_the_pulled_bytes() -> None:
    meta = PushMeta(0, 1, 1)
    pushes = [
        SparsePush("e", meta, torch.float32, 2, np.array([1, 2]), memoryview(bytes(16))),
        DensePush("w", meta, torch.float32, (3,), [(0, torch.zeros(3))]),
        DensePush("w", meta, torch.float32, (3,), [(0, torch.zeros(3))]),
        DensePush("w", meta, torch.float32, (3,), [(0, torch.zeros(3))]),
    ]
    exchange = Exchange(0, 1, 0, 0, pushes, True, 1, [Pull("w")])
    pulled = torch.arange(3, dtype=torch.float32)
    result = ExchangeResult([PushOutcome.APPLIED, PushOutcome.DUPLICATE, PushOutcome.DROPPED,
                             PushOutcome.KEPT], 4, [pulled])
    response, out = wire.exchange_to_proto(exchange, result)
    flags = [(p.duplicate, p.dropped, p.kept, p.elements) for p in response.pushes]
    assert flags == [(False, False, False, 4), (True, False, False, 3),
                     (False, True, False, 3), (False, False, True, 3)]
    assert response.open_clock == 4
    (answer,) = response.pulled
    assert list(answer.shape) == [3] and answer.dtype == pb.FLOAT32
    payload = codec.Received(out.parts)
    assert bytes(payload.span(answer.values, "pull")) == pulled.numpy().tobytes()


def test_a_table_spec_becomes_its_domain_value_and_a_bad_one_is_refused() -> None:
    msg = pb.TableSpec(name="e", consistency=pb.SSP, staleness=2)
    msg.sparse.dim = 8
    msg.sparse.dtype = pb.FLOAT32
    msg.sparse.seed = 5
    msg.optimizer.name = "adagrad"
    msg.optimizer.params["lr"] = 0.1
    spec = wire.spec_from_proto(msg)
    assert (spec.name, spec.kind, spec.dim, spec.seed, spec.dtype) == (
        "e", "sparse", 8, 5, torch.float32)
    assert spec.optimizer.name == "adagrad" and dict(spec.optimizer.params) == {"lr": 0.1}
    assert spec.mode == modes.parse("ssp:2")
    with pytest.raises(InvalidArgumentError, match="table 'x': set either dense or sparse"):
        wire.spec_from_proto(pb.TableSpec(name="x"))


def test_clocks_list_every_worker_in_order_with_liveness() -> None:
    state = ClockState(open_clock=3, clocks_closed=3, clocks={2: 4, 0: 3}, live=frozenset({2}))
    assert [(c.worker, c.clock, c.live) for c in wire.clocks_to_proto(state)] == [
        (0, 3, False), (2, 4, True)]
