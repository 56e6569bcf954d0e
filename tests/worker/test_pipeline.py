"""The exchange pipeline alone (worker/pipeline.py): which exchange carries which pushes and
pulls, in which order, and which ticket a module's forward gets. No server: a recording
client answers each pull with rows that name the exchange that carried it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest
import torch

from worker.errors import PSModuleError
from worker.pipeline import Outbox, Pipeline, Ticket
from worker.plan import Pull, Push


@dataclass
class Sent:
    pushes: list[str]
    end_iteration: bool
    pulls: list[str]
    push_clock: int
    pull_clock: int


@dataclass
class RecordingClient:
    """What Pipeline uses of PSClient: clock, worker and exchange. Each pulled tensor holds
    the number of the exchange that carried it."""

    clock: int = 0
    worker: int = 0
    sent: list[Sent] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def exchange(self, pushes: Sequence[Push] = (), *, end_iteration: bool = False,
                 pulls: Sequence[Pull] = (), push_clock: int | None = None,
                 pull_clock: int | None = None,
                 follow_open_clock: bool = True) -> list[torch.Tensor]:
        with self.lock:
            number = len(self.sent)
            self.sent.append(Sent([p.table for p in pushes], end_iteration,
                                  [p.table for p in pulls], push_clock or 0, pull_clock or 0))
            if end_iteration:
                self.clock = (push_clock or 0) + 1
        return [torch.full((1,), float(number)) for _ in pulls]


@dataclass
class MeetingClient(RecordingClient):
    """A RecordingClient whose exchanges each wait, up to MEET_S, for another to run beside
    it; `most` is the most that ever ran at once."""

    running: int = 0
    most: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)

    def exchange(self, *args: object, **kwargs: object) -> list[torch.Tensor]:
        with self.cond:
            self.running += 1
            self.most = max(self.most, self.running)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.running > 1, timeout=MEET_S)
        try:
            return super().exchange(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            with self.cond:
                self.running -= 1


CPU = torch.device("cpu")
MEET_S = 0.5


@dataclass
class Dense:
    table: str
    device: torch.device = CPU


@pytest.fixture
def client() -> RecordingClient:
    return RecordingClient()


@contextlib.contextmanager
def pipeline(client: RecordingClient, overlap: bool, dense: Sequence[Dense] = (),
             depth: int = 1, in_flight: int = 1) -> Iterator[Pipeline]:
    made = Pipeline(client, overlap, dense, depth, in_flight)  # type: ignore[arg-type]
    try:
        yield made
    finally:
        made.shutdown()


@pytest.fixture
def sync_pipeline(client: RecordingClient) -> Iterator[Pipeline]:
    with pipeline(client, overlap=False, dense=[Dense("mlp")]) as made:
        yield made


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_a_step_sends_its_pushes_end_and_the_next_steps_pulls_in_one_exchange(
    client: RecordingClient, sync_pipeline: Pipeline
) -> None:
    p = sync_pipeline
    owner = object()
    p.ask_ahead(owner, Ticket("emb", 1, CPU, ids(3, 1, 3)))
    p.outbox = Outbox(0, [Push("emb", torch.ones(2, 4), None)], None)
    p.ask_dense(1)
    p.dispatch(outbox=True, up_to=1)
    p.drain()
    assert client.sent == [Sent(["emb"], True, ["emb", "mlp"], 0, 1)]
    assert p.outbox is None and client.clock == 1


def test_pulls_for_different_steps_travel_in_order_one_exchange_each(
    client: RecordingClient, sync_pipeline: Pipeline
) -> None:
    p = sync_pipeline
    owner = object()
    for clock in (2, 1, 3):
        p.ask_ahead(owner, Ticket("emb", clock, CPU, ids(clock)))
    p.outbox = Outbox(0, [], None)
    p.dispatch(outbox=True, up_to=2)
    p.drain()
    # Step 1's pulls go with the outbox, step 2's next; step 3's are not due yet.
    assert [(s.end_iteration, s.pulls, s.pull_clock) for s in client.sent] == [
        (True, ["emb"], 1), (False, ["emb"], 2)]
    late = p.ticket_for(owner, 3, ids(3))
    assert late is not None and late.future is None
    assert p.wait(late).item() == 2  # waiting for it sends it, as a third exchange
    assert client.sent[-1].pull_clock == 3


def test_a_forward_gets_its_own_ticket_for_its_step_and_ids(sync_pipeline: Pipeline) -> None:
    p = sync_pipeline
    mine, other = object(), object()
    stale = Ticket("emb", 1, CPU, ids(1))
    changed = Ticket("emb", 2, CPU, ids(9))
    p.ask_ahead(mine, stale)
    p.ask_ahead(mine, changed)
    theirs = Ticket("emb", 2, CPU, ids(2))
    p.ask_ahead(other, theirs)
    # Step 2 with other ids than asked: the step-1 ticket and the mismatched one are dropped.
    assert p.ticket_for(mine, 2, ids(2)) is None
    assert p.ticket_for(mine, 2, ids(9)) is None
    # Another module's ticket for the same table is its own.
    assert p.ticket_for(other, 2, ids(2)) is theirs
    later = Ticket("emb", 4, CPU, ids(4))
    p.ask_ahead(mine, later)
    assert p.ticket_for(mine, 3, ids(4)) is None  # asked for a later step: kept
    assert p.ticket_for(mine, 4, ids(4)) is later


def test_forgetting_dense_tickets_leaves_the_sparse_ones(client: RecordingClient) -> None:
    mlp = Dense("mlp")
    with pipeline(client, overlap=False, dense=[mlp]) as p:
        owner = object()
        sparse = Ticket("emb", 1, CPU, ids(1))
        p.ask_ahead(owner, sparse)
        p.ask_dense(1)
        p.ask_dense(1)  # once per step
        p.forget_dense()
        assert p.ticket_for(mlp, 1, None) is None
        assert p.ticket_for(owner, 1, ids(1)) is sparse
        p.dispatch(outbox=False)
        p.drain()
        assert [s.pulls for s in client.sent] == [["emb", "mlp"]]


def test_overlap_sends_the_last_steps_gradients_at_the_next_forward(
    client: RecordingClient,
) -> None:
    with pipeline(client, overlap=True, dense=[Dense("mlp")]) as p:
        p.forward_started()  # step 0: nothing to send but the dense pull for step 1
        p.outbox = Outbox(0, [Push("emb", torch.ones(1, 2), None)], None)
        p.step_clock = 1
        assert len(client.sent) <= 1  # step() itself sends nothing
        p.forward_started()  # step 1's first forward sends step 0's gradients
        p.drain()
        assert [(s.pushes, s.end_iteration, s.pulls, s.pull_clock) for s in client.sent] == [
            ([], False, ["mlp"], 1), (["emb"], True, ["mlp"], 2)]


def test_deeper_the_exchange_leaves_when_the_forward_is_done(client: RecordingClient) -> None:
    with pipeline(client, overlap=True, dense=[Dense("mlp")], depth=2) as p:
        p.forward_started()  # step 0
        p.forward_started()  # a second PS module's forward
        p.drain()
        assert client.sent == []  # the forward needs the interpreter; the exchange waits
        p.forward_done()  # zero_grad(), before the backward
        p.forward_done()  # step(): already gone, nothing more
        p.drain()
        assert [(s.pushes, s.end_iteration, s.pulls, s.pull_clock) for s in client.sent] == [
            ([], False, ["mlp"], 2)]
        p.outbox = Outbox(0, [Push("emb", torch.ones(1, 2), None)], None)
        p.step_clock = 1
        p.forward_started()  # step 1 asks for step 3's values; step 0's gradients wait
        p.drain()
        assert len(client.sent) == 1
        p.forward_done()
        p.drain()
        assert [(s.pushes, s.end_iteration, s.pulls, s.pull_clock) for s in client.sent[1:]] == [
            (["emb"], True, ["mlp"], 3)]


def test_an_error_in_an_exchange_reaches_the_training_thread(client: RecordingClient) -> None:
    def refuse(*args: object, **kwargs: object) -> list[torch.Tensor]:
        raise PSModuleError("refused")

    client.exchange = refuse  # type: ignore[method-assign]
    with pipeline(client, overlap=False) as p:
        p.outbox = Outbox(0, [], None)
        p.dispatch(outbox=True)
        with pytest.raises(PSModuleError, match="refused"):
            p.drain()


@pytest.mark.parametrize("in_flight", [1, 2])
def test_exchanges_travel_as_many_at_once_as_in_flight_allows(in_flight: int) -> None:
    client = MeetingClient()
    with pipeline(client, overlap=True, depth=2, in_flight=in_flight) as p:
        owner = object()
        for clock in (1, 2):
            p.ask_ahead(owner, Ticket("emb", clock, CPU, ids(clock)))
        p.dispatch(outbox=False, up_to=2)  # one exchange per step's pulls
        p.drain()
    assert client.most == in_flight
    assert sorted(s.pull_clock for s in client.sent) == [1, 2]
    if in_flight == 1:
        assert [s.pull_clock for s in client.sent] == [1, 2]  # one at a time, in order


def test_in_flight_is_from_one_to_the_depth(client: RecordingClient) -> None:
    for depth, in_flight in ((1, 2), (2, 0), (2, 3)):
        with pytest.raises(ValueError, match=f"in_flight must be from 1 to depth {depth}"):
            Pipeline(client, True, [], depth, in_flight)  # type: ignore[arg-type]
