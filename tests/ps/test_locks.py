"""ps.locks.RWLock: readers share, a writer is alone, and a waiting writer goes before new
readers."""

from __future__ import annotations

import threading

from ps.locks import RWLock

WAIT_S = 5.0


def test_readers_share_and_a_writer_waits_for_them() -> None:
    lock = RWLock()
    order: list[str] = []
    with lock.shared(), lock.shared():  # two holders at once (nested, as two threads would)
        writer_in = threading.Event()

        def write() -> None:
            with lock.exclusive():
                order.append("writer")
                writer_in.set()

        t = threading.Thread(target=write)
        t.start()
        assert not writer_in.wait(0.2)  # readers still hold it
        order.append("readers out")
    assert writer_in.wait(WAIT_S)
    t.join(WAIT_S)
    assert order == ["readers out", "writer"]


def test_a_waiting_writer_goes_before_new_readers() -> None:
    lock = RWLock()
    order: list[str] = []
    reader_holds, writer_waits = threading.Event(), threading.Event()
    release_reader = threading.Event()

    def first_reader() -> None:
        with lock.shared():
            reader_holds.set()
            release_reader.wait(WAIT_S)
            order.append("first reader")

    def writer() -> None:
        writer_waits.set()
        with lock.exclusive():
            order.append("writer")

    def late_reader() -> None:
        with lock.shared():
            order.append("late reader")

    threads = [threading.Thread(target=first_reader)]
    threads[0].start()
    assert reader_holds.wait(WAIT_S)
    threads.append(threading.Thread(target=writer))
    threads[1].start()
    assert writer_waits.wait(WAIT_S)
    while not lock._writers_waiting:  # the writer is queued before the late reader comes
        threading.Event().wait(0.001)
    threads.append(threading.Thread(target=late_reader))
    threads[2].start()
    threading.Event().wait(0.1)
    assert order == []  # the late reader waits behind the queued writer
    release_reader.set()
    for t in threads:
        t.join(WAIT_S)
    assert order == ["first reader", "writer", "late reader"]


def test_the_exclusive_holder_is_alone_and_lets_everyone_in_after() -> None:
    lock = RWLock()
    inside = threading.Event()

    def read() -> None:
        with lock.shared():
            inside.set()

    with lock.exclusive():
        t = threading.Thread(target=read)
        t.start()
        assert not inside.wait(0.2)
    assert inside.wait(WAIT_S)
    t.join(WAIT_S)
    with lock.exclusive():  # nobody holds it any more
        pass
