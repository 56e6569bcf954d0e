"""The exchange plan, without a server: what each shard is sent, and how the answers are put
back in the caller's order."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch

from protos import codec
from protos import pstrain_pb2 as pb
from protos.partition import dense_placement, shard_of_keys
from worker.errors import PSClientError, UnknownTableError
from worker.plan import ExchangePlan, Pull, Push, table_lookup
from worker.routing import TableInfo

SHARDS = 3
TABLES = {
    "w": TableInfo("w", "dense", torch.float32, (30_000, 2), 0,
                   tuple(dense_placement("w", (30_000, 2), 4, SHARDS))),
    "e": TableInfo("e", "sparse", torch.float32, (), 4, ()),
}


def plan(end_iteration: bool = False) -> ExchangePlan:
    header = pb.ExchangeRequest(worker=2, incarnation=5, push_clock=7, pull_clock=8,
                                end_iteration=end_iteration)
    return ExchangePlan(header, table_lookup(TABLES), SHARDS, itertools.count(1))


def serve(request: pb.ExchangeRequest, payload: memoryview, rows: dict[int, float],
          writable: bool = False) -> tuple[pb.ExchangeResponse, codec.Received]:
    """What a shard would answer: dense blocks of its own rows, sparse rows key * 10."""
    out = codec.Payload()
    response = pb.ExchangeResponse()
    for pull in request.pulls:
        if pull.dense:
            block = TABLES["w"].placement[rows["shard"]]  # type: ignore[index]
            values = torch.arange(block.start * 2, block.end * 2, dtype=torch.float32)
            values = values.reshape(block.rows, 2)
        else:
            keys = codec.keys_from_bytes(codec.Received([payload]).span(pull.keys, "keys"))
            values = torch.from_numpy(keys.astype(np.float32) * 10).reshape(-1, 1).repeat(1, 4)
        response.pulled.append(pb.ExchangePulled(
            dtype=pb.FLOAT32, shape=list(values.shape),
            values=out.add(codec.tensor_bytes(values.contiguous()))))
    data = bytearray(out.nbytes)
    out.copy_into(memoryview(data))
    return response, codec.Received([memoryview(data if writable else bytes(data))])


def payload_of(request: pb.ExchangeRequest, payload: codec.Payload) -> memoryview:
    data = bytearray(payload.nbytes)
    payload.copy_into(memoryview(data))
    return memoryview(bytes(data))


def test_a_step_is_one_request_per_shard_and_answers_come_back_in_order() -> None:
    keys = np.array([9, -4, 9, 2**40, 0, 13, -4], dtype=np.int64)
    p = plan(end_iteration=True)
    p.push(Push("w", torch.ones(30_000, 2)))
    p.push(Push("e", torch.ones(len(keys), 4), keys))
    p.pull(Pull("w"))
    p.pull(Pull("e", keys))
    requests = p.requests()
    assert [i for i, *_ in requests] == list(range(SHARDS))  # every shard ends the iteration
    seqs = []
    for index, msg, payload, answer_bytes in requests:
        assert (msg.worker, msg.incarnation, msg.push_clock, msg.pull_clock) == (2, 5, 7, 8)
        assert msg.end_iteration
        seqs += [push.seq for push in msg.pushes]
        sparse = [push for push in msg.pushes if not push.dense]
        data = payload_of(msg, payload)
        for push in sparse:
            pushed = codec.keys_from_bytes(codec.Received([data]).span(push.keys, "keys"))
            assert (shard_of_keys(pushed, SHARDS) == index).all()
            assert len(set(pushed.tolist())) == len(pushed)  # repeats summed before sending
        response, answer = serve(msg, data, {"shard": index})
        assert answer.nbytes == answer_bytes
        p.unpack(index, response, answer)
    assert sorted(seqs) == list(range(1, len(seqs) + 1))  # every push numbered once
    dense, rows = p.results()
    torch.testing.assert_close(dense, torch.arange(60_000, dtype=torch.float32).reshape(-1, 2))
    expected = torch.from_numpy(keys.astype(np.float32) * 10).reshape(-1, 1).repeat(1, 4)
    torch.testing.assert_close(rows, expected)


def test_answers_unpacked_in_parallel_all_land() -> None:
    p = plan()
    p.pull(Pull("w"))
    # Shards answer on threads of their own: the tensor they share exists before any lands.
    assert all(out.values is not None for out in p._outputs)
    answers = []
    for index, msg, payload, _ in p.requests():
        answers.append((index, *serve(msg, payload_of(msg, payload), {"shard": index})))
    threads = [threading.Thread(target=p.unpack, args=a) for a in answers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (dense,) = p.results()
    torch.testing.assert_close(dense, torch.arange(60_000, dtype=torch.float32).reshape(-1, 2))


@pytest.mark.parametrize("writable", [False, True])
def test_a_pull_one_shard_answers_keeps_a_writable_answer_without_a_copy(writable: bool) -> None:
    keys = np.array([3], dtype=np.int64)
    p = plan()
    p.pull(Pull("e", keys))
    ((index, msg, payload, _),) = p.requests()
    response, answer = serve(msg, payload_of(msg, payload), {"shard": index}, writable)
    p.unpack(index, response, answer)
    (rows,) = p.results()
    assert rows.tolist() == [[30.0] * 4]
    (buffer,) = answer.buffers
    shares = rows.untyped_storage().data_ptr() == np.frombuffer(buffer, np.uint8).ctypes.data
    assert shares is writable  # read-only answers (gRPC's buffers) are copied


def test_undeclared_tables_and_wrong_kinds_are_refused_before_anything_is_sent() -> None:
    p = plan()
    with pytest.raises(UnknownTableError, match="table 'x' is not declared by this client"):
        p.pull(Pull("x"))
    with pytest.raises(PSClientError, match="table 'e' is sparse, not dense"):
        p.push(Push("e", torch.ones(1)))
    with pytest.raises(PSClientError, match=r"table 'w' has shape \[30000, 2\]; got \[2\]"):
        p.push(Push("w", torch.ones(2)))
    assert p.requests() == []


def test_an_answer_with_the_wrong_number_of_pulls_is_an_error() -> None:
    p = plan()
    p.pull(Pull("e", np.array([1], dtype=np.int64)))
    ((index, _, _, _),) = p.requests()
    with pytest.raises(PSClientError, match="answered 0 pulls of 1"):
        p.unpack(index, pb.ExchangeResponse(), memoryview(b""))


def test_assign_pushes_are_marked_and_need_no_unique_check() -> None:
    p = plan()
    p.push(Push("e", torch.ones(2, 4), np.array([5, 6], dtype=np.int64), assign=True))
    assert all(push.assign for _, msg, _, _ in p.requests() for push in msg.pushes)
