"""CutMarks, the worker's marks of checkpoint cuts: which requests carry a mark, its clock,
and when the worker asks every shard. No server: a fake clock and plain requests."""

from __future__ import annotations

import pytest

from protos import pstrain_pb2 as pb
from worker.cuts import CutMarks


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def sent(marks: CutMarks, clock: int, sends_iteration: bool = True) -> pb.ExchangeRequest:
    header = pb.ExchangeRequest(push_clock=clock)
    marks.done(marks.send(header, clock, sends_iteration))
    return header


def test_a_mark_rides_every_request_until_every_shard_answered_one() -> None:
    marks = CutMarks(3)
    sent(marks, 4)
    assert not sent(marks, 5).cut
    marks.answered(1, "", "c1", clock=6)
    header = sent(marks, 6)
    assert (header.cut, header.cut_clock) == ("c1", 6)
    marks.answered(0, "c1", "", clock=7)
    marks.answered(2, "c1", "", clock=7)
    assert sent(marks, 7).cut == "c1"  # shard 1 has not answered a request with it
    assert [marks.mark_for(s) for s in range(3)] == [None, ("c1", 6), None]
    marks.answered(1, "c1", "", clock=8)
    assert not sent(marks, 8).cut
    assert marks.mark_for(1) is None


@pytest.mark.parametrize(("last_sent", "worker_clock", "cut_clock"), [
    (-1, 0, 0),  # nothing sent yet
    (9, 7, 10),  # iterations up to 9 sent (a pipeline ahead of its answered clock)
    (3, 12, 12),  # the clock jumped to the shards' open clock past the last one sent
])
def test_the_cut_clock_is_the_first_iteration_not_sent(last_sent: int, worker_clock: int,
                                                       cut_clock: int) -> None:
    marks = CutMarks(1)
    if last_sent >= 0:
        sent(marks, last_sent)
    sent(marks, 50, sends_iteration=False)  # a pull: it sends no iteration
    marks.answered(0, "", "c1", clock=worker_clock)
    assert marks.mark_for(0) == ("c1", cut_clock)


def test_a_shard_that_tells_of_the_marked_cut_again_gets_the_same_mark() -> None:
    # A restarted shard, or one that began the cut after it had the mark, asks again: the
    # mark is the same, not a new clock (every shard cuts each worker at one clock; a shard
    # that holds later iterations by then gives the cut up).
    marks = CutMarks(2)
    sent(marks, 3)
    marks.answered(0, "", "c1", clock=4)
    for shard in (0, 1):
        marks.answered(shard, "c1", "", clock=5)
    sent(marks, 9)
    marks.answered(1, "", "c1", clock=10)
    assert [marks.mark_for(s) for s in range(2)] == [None, ("c1", 4)]
    assert (sent(marks, 10).cut_clock, marks.mark_for(1)) == (4, ("c1", 4))


def test_a_new_cut_waits_for_the_last_mark_to_reach_every_shard() -> None:
    marks = CutMarks(2)
    marks.answered(0, "", "c1", clock=0)
    marks.answered(0, "c1", "c2", clock=3)  # shard 1 still lacks c1
    assert marks.mark_for(0) is None and marks.mark_for(1) == ("c1", 0)
    marks.answered(1, "c1", "", clock=3)
    marks.answered(0, "", "c2", clock=3)  # told again
    assert [marks.mark_for(s) for s in range(2)] == [("c2", 3), ("c2", 3)]
    for shard in (0, 1):
        marks.answered(shard, "c2", "c1", clock=4)  # c1 told late: long marked
    assert [marks.mark_for(s) for s in range(2)] == [None, None]


def test_the_worker_asks_the_shards_while_an_exchange_waits_or_a_mark_is_on_its_way(
        clock: Clock) -> None:
    marks = CutMarks(2, probe_s=1.0, now=clock)
    assert not marks.due()
    waiting = marks.send(pb.ExchangeRequest(), 0, True)
    clock.t = 0.9
    assert not marks.due()
    clock.t = 1.0
    assert marks.due()
    marks.done(waiting)
    assert not marks.due()
    marks.answered(0, "", "c1", clock=1)  # at 1.0
    clock.t = 1.5
    assert not marks.due()
    clock.t = 2.0
    assert marks.due()  # neither shard has the mark after probe_s
    marks.answered(0, "c1", "", clock=1)
    marks.answered(1, "c1", "", clock=1)
    assert not marks.due()
