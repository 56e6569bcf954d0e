"""The transport registry and the selection rule, as tables of cases (no processes)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from protos import pstrain_pb2 as pb
from protos.transport import HandshakeError, TransportError, available, parse_choice, select, shm
from protos.transport.shm import size_class

HOST = "h/boot/1"


def offers(*names: str, host: str = HOST, missing: str = "") -> list[pb.TransportOffer]:
    out = [pb.TransportOffer(name="grpc", available=True)]
    for name in ("shm", "ucx"):
        ok = name in names
        out.append(pb.TransportOffer(name=name, available=ok, host=host,
                                     reason="" if ok else missing or f"no {name}"))
    return out


@pytest.mark.parametrize(
    ("client", "server", "client_forced", "server_forced", "chosen"),
    [
        (offers("shm", "ucx"), offers("shm", "ucx"), "", "", "shm"),
        (offers("ucx"), offers("shm", "ucx"), "", "", "ucx"),
        (offers("shm", "ucx"), offers("ucx"), "", "", "ucx"),
        (offers("shm"), offers("ucx"), "", "", "grpc"),
        (offers("shm", "ucx"), offers("shm", "ucx", host="other/boot/1"), "", "", "ucx"),
        (offers("shm"), offers("shm", host="other/boot/1"), "", "", "grpc"),
        (offers("shm", "ucx"), offers("shm", "ucx"), "grpc", "", "grpc"),
        (offers("shm", "ucx"), offers("shm", "ucx"), "", "ucx", "ucx"),
        (offers(), offers(), "", "", "grpc"),
    ],
    ids=["both-all", "client-no-shm", "server-no-shm", "nothing-shared", "other-host",
         "other-host-no-ucx", "client-forces-grpc", "server-forces-ucx", "neither"],
)
def test_select_picks_first_shared_in_preference_order(
    client: list[pb.TransportOffer], server: list[pb.TransportOffer], client_forced: str,
    server_forced: str, chosen: str,
) -> None:
    name, _ = select(client, server, client_forced, server_forced)
    assert name == chosen


def test_select_notes_why_faster_ones_were_passed_over() -> None:
    _, note = select(offers("shm"), offers("ucx", missing="ucxx is not installed"))
    assert "shm: server lacks it (ucxx is not installed)" in note
    assert "ucx: client lacks it (no ucx)" in note


@pytest.mark.parametrize(
    ("client", "server", "client_forced", "server_forced", "message"),
    [
        (offers("shm"), offers("ucx", missing="ucxx is not installed"), "ucx", "",
         "the client forces transport 'ucx'"),
        (offers("shm"), offers("shm", host="other/boot/1"), "shm", "",
         "client and server are on different hosts"),
        (offers(), offers("ucx"), "", "ucx", "the server forces transport 'ucx'"),
        (offers("shm"), offers("shm"), "shm", "grpc", "force the same one on both"),
    ],
    ids=["forced-missing-on-server", "forced-shm-across-hosts", "server-forced-missing",
         "forced-differently"],
)
def test_forced_transport_that_cannot_be_used_is_an_error(
    client: list[pb.TransportOffer], server: list[pb.TransportOffer], client_forced: str,
    server_forced: str, message: str,
) -> None:
    with pytest.raises(HandshakeError, match=message):
        select(client, server, client_forced, server_forced)


@pytest.mark.parametrize("value", ["rdma", "SHM2", "tcp"])
def test_unknown_transport_name_is_refused_naming_it(value: str) -> None:
    with pytest.raises(TransportError, match=f"unknown transport {value.lower()!r}"):
        parse_choice(value)


@pytest.mark.parametrize(("value", "name"), [(None, "auto"), ("", "auto"), (" SHM ", "shm"),
                                             ("grpc", "grpc"), ("ucx", "ucx")])
def test_choice_parsing(value: str | None, name: str) -> None:
    assert parse_choice(value).name == name


def test_grpc_and_shm_are_available_on_linux() -> None:
    assert available("grpc") == (True, "")
    assert available("shm")[0], available("shm")[1]


@pytest.mark.parametrize(
    ("nbytes", "size"),
    [(1, 65536), (65536, 65536), (65537, 131072), (1 << 20, 1 << 20),
     ((1 << 20) + 1, 1310720), (16 << 20, 16 << 20), ((16 << 20) + 4, 20 << 20)],
)
def test_size_classes_bound_the_waste(nbytes: int, size: int) -> None:
    assert size_class(nbytes) == size
    assert size < 2 * nbytes or nbytes <= 65536


@pytest.mark.parametrize("during", ["lease", "give_back"])
def test_a_region_given_back_by_a_finalizer_inside_the_pool_s_lock_does_not_deadlock(
        monkeypatch: pytest.MonkeyPatch, during: str) -> None:
    """A segment goes back to the pool from the finalizer of the last array viewing it, and
    the garbage collector runs finalizers wherever an object is allocated: also inside the
    pool's own sections, in the thread holding its lock."""
    pool = shm.Client(capacity_bytes=1 << 22)
    first, second, third = (pool.lease(100, 1) for _ in range(3))
    assert first is not None and second is not None and third is not None
    third.release()
    finalizers = [first.release, second.release]

    def collect() -> None:  # what a collection that finds a dropped answer array runs
        while finalizers:
            finalizers.pop()()

    if during == "lease":
        made = shm.ShmRegion.__init__

        def region(self: shm.ShmRegion, *args: Any) -> None:
            collect()
            made(self, *args)

        monkeypatch.setattr(shm.ShmRegion, "__init__", region)
        work = lambda: pool.lease(100, 1)  # noqa: E731
    else:
        held = pool.lease(100, 1)
        assert held is not None
        segments = pool._free

        class Free(dict):  # type: ignore[type-arg]
            def setdefault(self, *args: Any) -> Any:
                collect()
                return super().setdefault(*args)

        pool._free = Free(segments)
        work = held.release
    done = threading.Event()
    worker = threading.Thread(target=lambda: (work(), done.set()), daemon=True)
    worker.start()
    assert done.wait(10), "the pool deadlocked on its own lock"
    assert not finalizers
    assert len(pool.segments()) == 3


def test_a_ucx_buffer_given_back_by_a_finalizer_inside_the_pool_s_lock_does_not_deadlock(
) -> None:
    """The ucx pool takes buffers back from the same finalizer (an answer array's), so a
    collection inside its own section, in the thread holding its lock, must not hang it."""
    from protos.transport import ucx  # noqa: PLC0415 - loads no UCX library

    pool = ucx._Pool(capacity_bytes=1 << 22, cache_bytes=1 << 22)
    first, second = pool.take(100, strict=True), pool.take(100, strict=True)
    assert first is not None and second is not None
    finalizers = [lambda: pool.give(first, [])]

    class Free(dict):  # type: ignore[type-arg]
        def setdefault(self, *args: Any) -> Any:
            while finalizers:  # what a collection that finds a dropped answer array runs
                finalizers.pop()()
            return super().setdefault(*args)

    pool.free = Free()
    done = threading.Event()
    worker = threading.Thread(target=lambda: (pool.give(second, []), done.set()), daemon=True)
    worker.start()
    assert done.wait(10), "the pool deadlocked on its own lock"
    assert pool.used == 0 and sum(len(b) for b in pool.free.values()) == 2
