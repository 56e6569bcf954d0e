"""PSClient: a worker's connection to every shard of the parameter server.

It routes dense row blocks and sparse keys to their shards, de-duplicates keys, talks to
all shards in parallel and returns rows in the caller's order. Every data call is one
exchange per shard (worker/plan.py lays it out; a single pull or push is an exchange of one
item), sent over each shard's link (worker/link.py: transports, retries with backoff,
following a restarted server). Pushes are numbered, so a retry is never applied twice.

Typical use::

    client = PSClient(["10.0.0.1:7000", "10.0.0.2:7000"], worker=rank)
    client.declare_sparse("user_emb", dim=64, optimizer="adagrad", lr=0.05)
    rows = client.pull_sparse("user_emb", ids)          # [len(ids), 64]
    client.push_sparse("user_emb", ids, grad_rows)      # server runs Adagrad
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import grpc
import torch

from protos import codec, modes, rpc
from protos import pstrain_pb2 as pb
from protos.codec import Frame
from protos.partition import dense_placement
from protos.rpc import Resp, Rpc
from protos.runtime import tune_malloc
from protos.security import Security
from protos.transport import TransportError, parse_choice
from worker.bulk import BulkClient
from worker.cuts import CutMarks
from worker.errors import PSClientError, RolledBackError
from worker.link import Link, Reach, RetryPolicy
from worker.plan import ExchangePlan, Pull, Push, table_lookup, wire_dtype
from worker.routing import KeysLike, TableInfo

__all__ = ["KeysLike", "PSClient", "Pull", "Push", "RetryPolicy"]

log = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1024 * 1024


def _optimizer(name: str, params: dict[str, float]) -> pb.OptimizerSpec:
    return pb.OptimizerSpec(name=name, params=params)


def _consistency(mode: str | modes.Mode | None) -> dict[str, Any]:
    """A TableSpec's mode fields for a declared mode; "" or None keeps the server's."""
    try:
        parsed = modes.parse_optional(mode) if isinstance(mode, str) else mode
    except modes.ModeError as exc:
        raise PSClientError(str(exc)) from exc
    consistency, staleness = modes.to_proto(parsed)
    return {"consistency": consistency, "staleness": staleness}


class PSClient:
    """A connection to all shards. Thread-safe: calls may overlap from several threads.

    Every call blocks until each shard involved has answered or the retries are spent, and
    raises RemoteError carrying the server's status code and reason when a shard refuses.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        worker: int = 0,
        incarnation: int | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = 64 * MiB,
        resolve: Callable[[int], str | None] | None = None,
        observe: Callable[[str, float], None] | None = None,
        transport: str = "auto",
        lanes: bool = True,
        security: Security | None = None,
        job: str | None = None,
    ) -> None:
        if not addresses:
            raise PSClientError("PSClient needs at least one server address")
        self.worker = worker
        # A new process is a new incarnation: the start time in microseconds grows with every
        # start, so a rerun's pushes are never taken for duplicates of an earlier run's.
        self.incarnation = time.time_ns() // 1000 if incarnation is None else incarnation
        tune_malloc()
        # This worker's iteration count: pulls and pushes carry it, end_iteration advances it.
        self.clock = 0
        # The job's rollback count this process joined under (worker.init sets it).
        self.generation = 0
        # Guards dropped_pushes, and the clock where exchanges may end iterations in parallel.
        self._count_lock = threading.Lock()
        self.dropped_pushes = 0
        # Where the script is in its data (DataPosition.encode()), sent with each iteration's
        # end: the latest it set, or the one `hold_position` kept for that iteration. Join
        # sets `joined_position` to the servers' record of this rank (b"": none).
        self.position = b""
        self.joined_position = b""
        # Guards _held_positions.
        self._position_lock = threading.Lock()
        self._held_positions: dict[int, bytes] = {}
        # Told (what, seconds) of every call: the worker's latency metrics.
        self.observe = observe
        self._seq = itertools.count(1)
        # Guards _tables and _specs.
        self._lock = threading.Lock()
        self._tables: dict[str, TableInfo] = {}
        self._specs: dict[str, pb.TableSpec] = {}
        # Bulk transports: `transport` picks them ("auto": every one that works with a server);
        # `lanes`: send exchanges over a server's request lane where it offers one.
        try:
            choice = parse_choice(transport)
        except TransportError as exc:
            raise PSClientError(f"transport: {exc}") from exc
        self._reach = Reach(
            worker=worker, num_shards=len(addresses), timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s, retry=retry or RetryPolicy(),
            options=[("grpc.max_receive_message_length", max_message_bytes),
                     ("grpc.max_send_message_length", max_message_bytes)],
            bulk=BulkClient(choice, worker, self.incarnation, lanes), resolve=resolve,
            specs=self._declared_specs, security=security or Security(), job=job,
        )
        # One link per shard, in shard order.
        self.links: list[Link] = []
        try:
            for i, address in enumerate(addresses):
                self.links.append(Link.open(i, address, self._reach))
        except BaseException:
            # Nothing half-made outlives a failed constructor (sessions, transport state).
            self._disconnect()
            raise
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, 2 * len(self.links)), thread_name_prefix="psclient"
        )
        # Checkpoint cuts: the marks, and a thread that delivers them while exchanges wait.
        self.cuts = CutMarks(len(self.links))
        self._closing = threading.Event()
        self._prober = threading.Thread(target=self._probe_while_waiting, daemon=True,
                                        name=f"psclient-cuts-{worker}")
        self._prober.start()

    @property
    def timeout_s(self) -> float:
        """How long one try of a call may take, in seconds."""
        return self._reach.timeout_s

    @property
    def on_rolled_back(self) -> Callable[[], None] | None:
        """Called (from whichever thread made the call) when a server refuses this process
        because the job rolled back since it joined, or because the scheduler declared this
        incarnation dead, before RolledBackError is raised.
        worker.init sets it to exit the script for its supervisor to start it again."""
        return self._reach.on_rolled_back

    @on_rolled_back.setter
    def on_rolled_back(self, hook: Callable[[], None] | None) -> None:
        self._reach.on_rolled_back = hook

    @property
    def num_shards(self) -> int:
        return len(self.links)

    def close(self) -> None:
        """Closes every link. Idempotent."""
        self._closing.set()
        self._prober.join()
        self._pool.shutdown(wait=True)
        self._disconnect()

    def _disconnect(self) -> None:
        """Ends every link's bulk session and closes its channel, then the transports."""
        for link in self.links:
            link.close()
        self._reach.bulk.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _declared_specs(self) -> list[pb.TableSpec]:
        with self._lock:
            return list(self._specs.values())

    # ---- calls -------------------------------------------------------------------------------

    def _each(self, jobs: Sequence[tuple[Link, Callable[[], T]]], what: str) -> list[T]:
        """Runs one call per link, with retries, in parallel when there are several."""
        start = time.perf_counter()
        if len(jobs) == 1:
            link, call = jobs[0]
            results = [link.call(what, call)]
        else:
            futures = [self._pool.submit(link.call, what, call) for link, call in jobs]
            results = [f.result() for f in futures]
        if self.observe is not None:
            self.observe(what, time.perf_counter() - start)
        return results

    def _header(self, push_clock: int, end_iteration: bool,
                pull_clock: int) -> pb.ExchangeRequest:
        """The fields every shard's part of an exchange carries."""
        return pb.ExchangeRequest(
            worker=self.worker, incarnation=self.incarnation, generation=self.generation,
            wait_ms=self._wait_ms(), push_clock=push_clock, end_iteration=end_iteration,
            pull_clock=pull_clock, acked_clock=self.clock,
        )

    def _probe_while_waiting(self) -> None:
        """Asks every shard with an empty exchange, carrying the cut mark a shard lacks,
        whenever `self.cuts` says it is due (see worker/cuts.py), until the client closes."""
        while not self._closing.wait(self.cuts.probe_s / 4):
            if not self.cuts.due():
                continue
            for index, link in enumerate(self.links):
                if self._closing.is_set():
                    return
                header = self._header(self.clock, False, self.clock)
                mark = self.cuts.mark_for(index)
                if mark is not None:
                    header.cut, header.cut_clock = mark
                request = codec.encode(header, {"payload": []})
                try:
                    # Short: a paused shard must not keep the others from their probes.
                    answer = link.unary(rpc.EXCHANGE, request, self.cuts.probe_s * 2).msg
                except (grpc.RpcError, PSClientError) as exc:  # exchanges under way report it
                    log.debug("worker %d: probe of shard %d failed: %s", self.worker, index,
                              exc)
                    continue
                self.cuts.answered(index, header.cut, answer.cut, self.clock)

    def _everywhere(self, method: Rpc[Any, Resp], request: bytes, what: str) -> list[Frame[Resp]]:
        """One unary call on every shard, in shard order."""
        return self._each([(link, partial(link.unary, method, request)) for link in self.links],
                          what)

    def _wait_ms(self) -> int:
        # The server gives up a little before the call's own deadline, so the caller gets the
        # server's account of what it waited for rather than a bare timeout.
        return max(1, int(self.timeout_s * 900))

    def transports(self) -> list[str]:
        """The bulk transport each shard uses now, in shard order. Thread-safe."""
        return [link.transport for link in self.links]

    def transport_details(self) -> list[str]:
        """Each shard's transport and, where the transport says, what it runs over (a
        device or protocol, in brackets), in shard order. Thread-safe."""
        return [link.transport_detail for link in self.links]

    def exchange_lanes(self) -> list[bool]:
        """Whether each shard's exchanges take its transport's request lane now (a round trip
        of a fraction of a millisecond on one host), in shard order. Thread-safe."""
        return [link.has_lane for link in self.links]

    # ---- clocks ----------------------------------------------------------------------------

    def end_iteration(self) -> int:
        """Ends iteration `self.clock` on every shard, then advances the clock. Blocks.

        Call it once per iteration after that iteration's pushes: sync clocks close and
        ssp pulls of other workers move on when every worker has done so. A worker that fell
        behind closed sync clocks (a backup, a straggler) jumps to the oldest open one, so it
        carries on from the newest parameters instead of pushing gradients bound to be dropped.
        """
        clock = self.clock
        # An exchange with no pushes and no pulls: it reaches every shard.
        self._exchange_answers(f"end iteration {clock}", end_iteration=True, push_clock=clock)
        return self.clock

    def _ended(self, clock: int, open_clocks: Sequence[int]) -> int:
        """Moves the clock past iteration `clock`, and on to the oldest of the shards' open
        sync clocks (none given: no jump). Only forward; thread-safe."""
        ended = clock + 1
        if open_clocks:
            ended = max(ended, min(open_clocks))
        with self._count_lock:
            self.clock = max(self.clock, ended)
            return self.clock

    def hold_position(self, clock: int) -> None:
        """Keeps the current `position` for the end of iteration `clock`, for callers that
        end iterations after the script has moved on (a pipeline). Thread-safe."""
        with self._position_lock:
            self._held_positions[clock] = self.position

    def join(self) -> int:
        """Announces this process (its incarnation) to every shard; sets and returns its clock.

        A restarted worker calls this first: it resumes at the newest clock any shard has for
        its rank, and shards behind that are ticked up to it. Pushes from older incarnations
        are refused from then on.
        """
        frames = self._join_all()
        clock = int(max(f.msg.clock for f in frames))
        # Every shard keeps the position sent with each iteration's end; those at the
        # newest clock know the latest.
        self.joined_position = next(
            (f.msg.position.encode() for f in frames if f.msg.clock == clock and f.msg.position),
            b"")
        for link, frame in zip(self.links, frames, strict=True):
            for behind in range(frame.msg.clock, clock):
                tick = pb.ExchangeRequest(
                    worker=self.worker, incarnation=self.incarnation, generation=self.generation,
                    push_clock=behind, end_iteration=True, pull_clock=behind + 1,
                )
                link.call("catch up",
                          partial(link.unary, rpc.EXCHANGE, tick.SerializeToString()))
        self.clock = clock
        return clock

    def live_everywhere(self) -> bool:
        """Whether every shard lists this worker as live (sync pushes need it)."""
        return all(f.msg.live for f in self._join_all())

    def live_on(self) -> list[int]:
        """The shards that list this worker as live (none, once it has finished). Blocks
        for one join per shard; thread-safe."""
        return [k for k, f in enumerate(self._join_all()) if f.msg.live]

    def _join_all(self) -> list[Frame[pb.JoinResponse]]:
        """Join on every shard; repeating it for the same incarnation changes nothing."""
        data = pb.JoinRequest(worker=self.worker, incarnation=self.incarnation,
                              generation=self.generation).SerializeToString()
        return self._everywhere(rpc.JOIN, data, "join")

    def set_membership(self, live_workers: Sequence[int]) -> dict[int, int]:
        """Admin: tells every shard which workers are live; returns worker -> clock.

        Removed workers stop counting for sync quorums and ssp bounds at once; added ones
        enter at the current clock. Normally the scheduler calls this.
        """
        request = pb.MembershipRequest(live_workers=list(live_workers)).SerializeToString()
        frames = self._everywhere(rpc.SET_MEMBERSHIP, request, "set membership")
        return {c.worker: c.clock for c in frames[0].msg.clocks}

    # ---- tables ----------------------------------------------------------------------------

    def declare_dense(
        self, name: str, shape: Sequence[int], *, dtype: torch.dtype = torch.float32,
        optimizer: str = "sgd", init: tuple[str, float, float] = ("zeros", 0.0, 0.0),
        seed: int = 0, allow_non_finite: bool = False, mode: str | modes.Mode | None = "",
        **hyper: float,
    ) -> None:
        """Declares a dense tensor (split by rows across shards). Idempotent for the same spec.

        `hyper` are the optimizer's hyperparameters (lr, eps, beta1, ...). `mode` is the
        table's consistency mode ("sync", "ssp", "ssp:S", "async", or a protos.modes.Mode);
        "" keeps the servers' default. PSClientError for a mode outside that grammar.
        """
        spec = pb.TableSpec(
            name=name,
            dense=pb.DenseSpec(
                shape=list(shape), dtype=wire_dtype(dtype),
                init=pb.Initializer(kind=init[0], a=init[1], b=init[2]), seed=seed,
            ),
            optimizer=_optimizer(optimizer, hyper), allow_non_finite=allow_non_finite,
            **_consistency(mode),
        )
        placement = tuple(dense_placement(name, tuple(shape), dtype.itemsize, self.num_shards))
        self._declare(spec, TableInfo(name, "dense", dtype, tuple(shape), 0, placement))

    def declare_sparse(
        self, name: str, dim: int, *, dtype: torch.dtype = torch.float32,
        optimizer: str = "sgd", init: tuple[str, float, float] = ("uniform", -0.05, 0.05),
        seed: int = 0, allow_non_finite: bool = False, mode: str | modes.Mode | None = "",
        admit: str = "always", admit_default: float = 0.0, ttl_clocks: int = 0,
        ttl_s: float = 0.0, max_rows: int = 0, **hyper: float,
    ) -> None:
        """Declares a sparse table of rows of width `dim`, created on first touch. Idempotent.

        `admit` says when an id gets a row: "always", "count:K" (on its K-th pull) or
        "prob:P" (a fixed share P of ids, chosen by hash); until then its pulls read
        `admit_default` and its gradients are dropped. Rows untouched for `ttl_clocks`
        clocks or `ttl_s` seconds are evicted, and past `max_rows` rows per server the least
        recently touched (0: off). The servers refuse bad values (PSClientError naming
        them). `mode` and `hyper` as in declare_dense.
        """
        spec = pb.TableSpec(
            name=name,
            sparse=pb.SparseSpec(
                dim=dim, dtype=wire_dtype(dtype),
                init=pb.Initializer(kind=init[0], a=init[1], b=init[2]), seed=seed,
                admit=admit, admit_default=admit_default, ttl_clocks=ttl_clocks, ttl_s=ttl_s,
                max_rows=max_rows,
            ),
            optimizer=_optimizer(optimizer, hyper), allow_non_finite=allow_non_finite,
            **_consistency(mode),
        )
        self._declare(spec, TableInfo(name, "sparse", dtype, (), dim, ()))

    def _declare(self, spec: pb.TableSpec, table: TableInfo) -> None:
        request = pb.DeclareTablesRequest(tables=[spec]).SerializeToString()
        with self._lock:
            self._specs[spec.name] = spec
        self._everywhere(rpc.DECLARE_TABLES, request, f"declare {spec.name!r}")
        with self._lock:
            self._tables[spec.name] = table

    # ---- data: every call is an exchange ---------------------------------------------------

    def pull_dense(self, name: str, *, clock: int | None = None) -> torch.Tensor:
        """The whole dense tensor `name`, assembled from every shard's rows. Blocks.

        `clock` defaults to this worker's clock; the table's mode may make the pull wait.
        """
        return self._exchange(f"pull {name!r}", pulls=[Pull(name)], pull_clock=clock)[0]

    def push_dense(self, name: str, grad: torch.Tensor, *, clock: int | None = None) -> None:
        """Sends the gradient of dense tensor `name`; the servers apply their optimizer once.

        `clock` defaults to this worker's clock.
        """
        self._exchange(f"push {name!r}", pushes=[Push(name, grad)], push_clock=clock)

    def assign_dense(self, name: str, values: torch.Tensor, *, if_absent: bool = False) -> bool:
        """Overwrites dense tensor `name` (initialising it from a module, for example). Blocks.

        With `if_absent`, each shard writes its rows only if they were never written (by an
        assign, an applied gradient, or a restore of saved values) and otherwise keeps what
        it holds: the first of several workers racing writes each shard's rows, and a
        restarted worker never overwrites trained values. Shards decide alone, so the
        tensor may end up mixing several workers' values, one shard's rows each; pull it to
        see what the servers hold.

        Returns True when every shard took `values` (always, without `if_absent`), False
        when some shard kept its values. A shard that answers a retry as a duplicate (its
        first answer lost) counts as having taken them: it no longer knows which way it went.
        """
        answers = self._exchange_answers(
            f"push {name!r}", pushes=[Push(name, values, assign=True, if_absent=if_absent)],
            push_clock=0,
        )[1]
        return not any(result.kept for answer in answers for result in answer.pushes)

    def pull_sparse(
        self, name: str, keys: KeysLike, *, clock: int | None = None,
        assume_unique: bool = False,
    ) -> torch.Tensor:
        """Rows of `keys` as a `[len(keys), dim]` tensor, in the order given. Blocks.

        Repeated keys are fetched once. `clock` defaults to this worker's clock.
        `assume_unique` skips de-duplication for callers whose keys are unique.
        """
        return self._exchange(f"pull {name!r}", pulls=[Pull(name, keys, assume_unique)],
                              pull_clock=clock)[0]

    def push_sparse(
        self, name: str, keys: KeysLike, grads: torch.Tensor, *, clock: int | None = None,
        assume_unique: bool = False,
    ) -> None:
        """Sends gradient rows for `keys`; the servers run the table's optimizer on them.

        Gradients of repeated keys are summed first, as for a coalesced sparse gradient.
        `clock` defaults to this worker's clock.
        """
        self._exchange(f"push {name!r}", pushes=[Push(name, grads, keys, assume_unique)],
                       push_clock=clock)

    def assign_sparse(self, name: str, keys: KeysLike, values: torch.Tensor) -> None:
        """Overwrites the rows of `keys` (unique keys) with `values`."""
        self._exchange(f"push {name!r}", pushes=[Push(name, values, keys, True, assign=True)],
                       push_clock=0)

    def exchange(
        self, pushes: Sequence[Push] = (), *, end_iteration: bool = False,
        pulls: Sequence[Pull] = (), push_clock: int | None = None,
        pull_clock: int | None = None, follow_open_clock: bool = True,
    ) -> list[torch.Tensor]:
        """Pushes gradients, ends the iteration and pulls, in one request per shard. Blocks.

        Each shard applies its part of `pushes` (gradients, at `push_clock`, default this
        worker's clock), then ends iteration `push_clock` if `end_iteration` (advancing the
        clock as `end_iteration()` does), then answers its part of `pulls` at `pull_clock`
        (default: the clock after the iteration, or the current one), waiting as the tables'
        modes say. Returns one tensor per pull, in order: a dense table whole, or a sparse
        pull's `[len(keys), dim]` rows in the caller's order.

        The same as the separate calls in that order, at the cost of one round trip per
        shard; pushes keep their exactly-once numbering, so a retried exchange applies
        nothing twice, and a shard applies nothing of a request until all of it has arrived.
        `follow_open_clock=False` keeps the clock from jumping to the oldest open sync
        clock: for callers with several exchanges of their own in flight, whose later ticks
        may have closed clocks already.
        Thread-safe; the clock only moves forward.
        """
        return self._exchange(f"exchange {push_clock}", pushes, end_iteration, pulls,
                              push_clock, pull_clock, follow_open_clock)

    def _exchange(
        self, what: str, pushes: Sequence[Push] = (), end_iteration: bool = False,
        pulls: Sequence[Pull] = (), push_clock: int | None = None,
        pull_clock: int | None = None, follow_open_clock: bool = True,
    ) -> list[torch.Tensor]:
        return self._exchange_answers(what, pushes, end_iteration, pulls, push_clock,
                                      pull_clock, follow_open_clock)[0]

    def _exchange_answers(
        self, what: str, pushes: Sequence[Push] = (), end_iteration: bool = False,
        pulls: Sequence[Pull] = (), push_clock: int | None = None,
        pull_clock: int | None = None, follow_open_clock: bool = True,
    ) -> tuple[list[torch.Tensor], list[pb.ExchangeResponse]]:
        """As `exchange`; also returns each involved shard's answer, in shard order."""
        generation = self.generation
        try:
            return self._exchange_once(what, pushes, end_iteration, pulls, push_clock,
                                       pull_clock, follow_open_clock)
        except RolledBackError:
            # A read-only exchange of a worker whose rollback hook took the new generation
            # instead of restarting (it had finished) is asked again under it; a worker that
            # pushes must restart.
            if pushes or end_iteration or self.generation == generation:
                raise
            return self._exchange_once(what, pushes, end_iteration, pulls, push_clock,
                                       pull_clock, follow_open_clock)

    def _exchange_once(
        self, what: str, pushes: Sequence[Push], end_iteration: bool,
        pulls: Sequence[Pull], push_clock: int | None, pull_clock: int | None,
        follow_open_clock: bool,
    ) -> tuple[list[torch.Tensor], list[pb.ExchangeResponse]]:
        push_clock = self.clock if push_clock is None else push_clock
        if pull_clock is None:
            pull_clock = push_clock + 1 if end_iteration else self.clock
        header = self._header(push_clock, end_iteration, pull_clock)
        if end_iteration:
            with self._position_lock:
                header.position = self._held_positions.pop(push_clock, self.position).decode()
                for old in [c for c in self._held_positions if c < push_clock]:
                    del self._held_positions[old]
        with self._lock:
            tables = dict(self._tables)
        number = self.cuts.send(header, push_clock, bool(pushes or end_iteration))
        try:
            plan = ExchangePlan(header, table_lookup(tables), self.num_shards, self._seq)
            for push in pushes:
                plan.push(push)
            for pull in pulls:
                plan.pull(pull)

            def send(index: int, msg: pb.ExchangeRequest, payload: Any,
                     answer_bytes: int) -> pb.ExchangeResponse:
                answer, data = self.links[index].exchange(msg, payload, answer_bytes)
                self.cuts.answered(index, msg.cut, answer.cut, self.clock)
                plan.unpack(index, answer, data)
                return answer

            jobs = [(self.links[i], partial(send, i, msg, payload, answer_bytes))
                    for i, msg, payload, answer_bytes in plan.requests()]
            answers = self._each(jobs, what)
        finally:
            self.cuts.done(number)
        dropped = sum(result.dropped for answer in answers for result in answer.pushes)
        if dropped:
            with self._count_lock:
                self.dropped_pushes += dropped
        if end_iteration:
            self._ended(push_clock, [a.open_clock for a in answers] if follow_open_clock else [])
        return plan.results(), answers

    # ---- introspection ---------------------------------------------------------------------

    def stats(self, *, pull_log: bool = False, history: bool = False) -> list[pb.StatsResponse]:
        """Every shard's counters, clocks and table sizes, in shard order.

        `pull_log` adds the record of served ssp pulls, `history` that of recent sync clocks.
        """
        request = pb.StatsRequest(pull_log=pull_log, history=history).SerializeToString()
        return [f.msg for f in self._everywhere(rpc.GET_STATS, request, "stats")]
