"""A streamed exchange is all or nothing: cut at any part boundary (cancelled, past its
deadline, its client SIGKILLed) it applies nothing, and its retry under the same push ids
applies everything exactly once, over every transport."""

from __future__ import annotations

import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from procs import Procs

from protos import codec, rpc
from protos import pstrain_pb2 as pb
from protos.parts import cut
from worker.client import PSClient, Push

pytestmark = pytest.mark.usefixtures("transport")

CHUNK = 16 * 1024
KEYS = np.arange(0, 3000, 3, dtype=np.int64)
DENSE = torch.linspace(-1, 1, 64 * 64).reshape(64, 64)
SPARSE = torch.linspace(-2, 2, len(KEYS) * 8).reshape(len(KEYS), 8)
WORKER, INCARNATION = 9, 1


def request_parts() -> list[bytes]:
    """The one exchange every attempt sends: a dense and a sparse push, push ids 1 and 2 (the
    numbers a fresh PSClient gives its first two pushes)."""
    msg = pb.ExchangeRequest(worker=WORKER, incarnation=INCARNATION)
    payload = codec.Payload()
    msg.pushes.append(pb.ExchangePush(table="w", seq=1, dtype=pb.FLOAT32, dense=True,
                                      shape=[64, 64], values=payload.add(
                                          codec.tensor_bytes(DENSE))))
    msg.pushes.append(pb.ExchangePush(table="e", seq=2, dtype=pb.FLOAT32, dim=8,
                                      keys=payload.add(codec.keys_bytes(KEYS)),
                                      values=payload.add(codec.tensor_bytes(SPARSE))))
    return list(cut(pb.ExchangePart, msg, payload.parts, payload.nbytes, CHUNK))


def declare(client: PSClient) -> None:
    client.declare_dense("w", (64, 64), optimizer="sgd", lr=1.0, init=("zeros", 0, 0))
    client.declare_sparse("e", 8, optimizer="sgd", lr=1.0, init=("zeros", 0, 0))


def applied(client: PSClient) -> dict[str, tuple[int, int]]:
    return {t.name: (t.pushes_applied, t.pushes_duplicate) for t in client.stats()[0].tables}


def send_until(channel: grpc.Channel, parts: list[bytes], keep: int, how: str) -> None:
    """Sends the first `keep` parts, then ends the call as `how` says, short of the rest."""
    release = threading.Event()

    def stream() -> Iterator[bytes]:
        yield from parts[:keep]
        release.wait(10)

    call = channel.stream_stream(f"/{rpc.SERVICE}/ExchangeStream")(
        stream(), timeout=0.5 if how == "deadline" else 10)
    if how == "cancel":
        time.sleep(0.2)  # let the parts reach the server
        call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    release.set()
    expected = "DEADLINE_EXCEEDED" if how == "deadline" else "CANCELLED"
    assert err.value.code().name == expected


def test_a_cut_stream_applies_nothing_and_its_retry_applies_once(
    procs: Procs, transport: str, tmp_path: Path
) -> None:
    server = procs.server(extra=["--chunk-mib", str(CHUNK / 2**20)])
    parts = request_parts()
    assert len(parts) >= 4
    with PSClient([server.address], worker=0, transport=transport) as observer:
        declare(observer)
        channel = grpc.insecure_channel(server.address)
        for keep in range(len(parts)):
            for how in ("cancel", "deadline"):
                send_until(channel, parts, keep, how)
        # A client process SIGKILLed after each number of parts: it sends raw parts (no torch,
        # so each start is quick) and kills itself.
        saved = tmp_path / "parts.bin"
        saved.write_bytes(b"".join(len(p).to_bytes(8, "little") + p for p in parts))
        for keep in range(len(parts)):
            killer = procs.spawn([sys.executable, "-c", textwrap.dedent(f"""
                import os, signal, threading, grpc
                data = open({str(saved)!r}, "rb").read()
                parts, pos = [], 0
                while pos < len(data):
                    n = int.from_bytes(data[pos:pos + 8], "little")
                    parts.append(data[pos + 8:pos + 8 + n])
                    pos += 8 + n
                sent = threading.Event()
                def stream():
                    yield from parts[:{keep}]
                    sent.set()
                    threading.Event().wait(60)
                channel = grpc.insecure_channel({server.address!r})
                call = channel.stream_stream("/{rpc.SERVICE}/ExchangeStream")(stream(),
                                                                               timeout=60)
                threading.Thread(target=lambda: list(call), daemon=True).start()
                sent.wait(30)
                threading.Event().wait(0.2)
                os.kill(os.getpid(), signal.SIGKILL)
            """)], f"killed-after-{keep}")
            killer.popen.wait(30)
            assert killer.popen.returncode == -9
        time.sleep(0.3)  # the server sees the last connection go
        assert applied(observer) == {"w": (0, 0), "e": (0, 0)}
        assert not observer.pull_dense("w").any()
        assert not observer.pull_sparse("e", KEYS).any()
        # The retry: the same worker, incarnation and push ids, through this transport.
        with PSClient([server.address], worker=WORKER, incarnation=INCARNATION,
                      transport=transport) as retry:
            declare(retry)
            retry.exchange([Push("w", DENSE), Push("e", SPARSE, KEYS, assume_unique=True)])
        # And the whole stream once more: answered as duplicates.
        call = channel.stream_stream(f"/{rpc.SERVICE}/ExchangeStream")(iter(parts), timeout=10)
        (answer,) = [codec.decode(pb.ExchangeAnswerPart, a) for a in call]
        assert [p.duplicate for p in answer.msg.response.pushes] == [True, True]
        channel.close()
        assert applied(observer) == {"w": (1, 1), "e": (1, 1)}
        torch.testing.assert_close(observer.pull_dense("w"), -DENSE, atol=0, rtol=0)
        torch.testing.assert_close(observer.pull_sparse("e", KEYS), -SPARSE, atol=0, rtol=0)
