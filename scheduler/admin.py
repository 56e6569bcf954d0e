"""Admin calls from the scheduler to parameter servers, over gRPC (the wire contract only),
and the health probe behind `pstrain health`."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import pstrain_pb2 as pb
from protos import rpc
from protos.rpc import Stubs
from protos.security import Security
from scheduler.errors import ConfigError, CoordinationError
from scheduler.spec import JobSpec
from scheduler.store import JobStore


class ServerAdmin:
    """One channel per server address, with the admin role's credentials (`security`);
    calls block up to `timeout_s`. Not thread-safe."""

    def __init__(self, timeout_s: float = 5.0, security: Security | None = None) -> None:
        self.timeout_s = timeout_s
        self.security = security or Security()
        self._channels: dict[str, tuple[grpc.Channel, Stubs]] = {}

    def _stubs(self, address: str) -> Stubs:
        found = self._channels.get(address)
        if found is None:
            channel = self.security.channel(address)
            found = self._channels[address] = (channel,
                                               Stubs(channel, self.security.call_metadata()))
        return found[1]

    def set_membership(self, address: str, live: list[int],
                       fenced: Mapping[int, int] | None = None) -> pb.MembershipResponse:
        """Tells a server which workers are live, and which incarnations were declared dead
        (worker -> incarnation: the server refuses them from then on)."""
        request = pb.MembershipRequest(live_workers=live,
                                       fenced=dict(fenced or {})).SerializeToString()
        return self._stubs(address).unary(rpc.SET_MEMBERSHIP, request, self.timeout_s).msg

    def restore(self, address: str, checkpoint_id: str, sha256: str, generation: int) -> int:
        """Has the server at `address` load its file of a checkpoint (found by id in its own
        checkpoint directory, checked against `sha256`); returns its clock."""
        request = pb.RestoreRequest(checkpoint_id=checkpoint_id, sha256=sha256,
                                    generation=generation).SerializeToString()
        # A large shard takes a while to read.
        answer = self._stubs(address).unary(rpc.RESTORE, request, max(self.timeout_s, 300.0))
        return int(answer.msg.clock)

    def close(self) -> None:
        for channel, _ in self._channels.values():
            channel.close()
        self._channels.clear()


def check_address(address: str) -> str:
    """`address` if it reads HOST:PORT (IPv6 as [::1]:PORT); ConfigError quoting it if not."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"address must be HOST:PORT with a port in [1, 65535], got {address!r}")
    return address


def health(address: str, service: str = "", timeout_s: float = 2.0,
           security: Security | None = None) -> str:
    """Asks the standard gRPC health service at `address` about `service` ("" is the server
    as a whole), with `security`'s credentials. Blocks up to `timeout_s`; returns the status
    name (SERVING, NOT_SERVING, SERVICE_UNKNOWN, ...) or, when the server cannot be asked,
    the gRPC error's code and details. Thread-safe (each call has its own channel)."""
    check_address(address)
    security = security or Security()
    with security.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s,
                               metadata=security.call_metadata() or None)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


# How long a sync checkpoint request may go unanswered before it is asked again at a later
# clock (at least ten heartbeat intervals).
SYNC_RETRY_S = 5.0


def take_checkpoint(store: JobStore, wait_s: float, full: bool = False,
                    prefix: str = "manual") -> tuple[str, dict[int, dict[str, Any]]] | str:
    """Asks the job's servers for a checkpoint now (`full`: not a delta) and waits up to
    `wait_s` for every shard to record it: (its id, shard -> entry), or a sentence saying
    why it is not complete. Sync jobs cut at a clock every shard has still to reach; async
    and ssp jobs at the workers' next steps (a consistent cut). CoordinationError when the
    job does not exist or has no checkpoint directory. Blocks."""
    spec = store.spec()
    if spec is None:
        raise CoordinationError(f"no job {store.keys.job!r} in this Redis")
    if not spec.checkpoint_dir:
        raise CoordinationError(
            f"job {spec.job!r} has no checkpoint directory; start it with --checkpoint-dir"
        )
    deadline = time.monotonic() + wait_s
    seen = next((e.id for e in store.recent_events(1)), "-")
    while True:
        at_clock = _clock_ahead(store, spec) if spec.mode == "sync" else -1
        checkpoint_id = f"{prefix}-{int(time.time() * 1000):015d}"
        store.request_checkpoint(checkpoint_id, at_clock, full=full)
        # A sync clock aimed at from late heartbeats may be passed before a shard hears of
        # it: the shard says it skipped it, and the request is made again at a later clock
        # (after a while without word, too). An async cut completes or is given up by the
        # servers themselves, saying why.
        again = time.monotonic() + max(SYNC_RETRY_S, 10 * spec.heartbeat_interval_s)
        while time.monotonic() < deadline:
            entries = store.checkpoint(checkpoint_id)
            if len(entries) == spec.servers:
                return checkpoint_id, entries
            seen, reason = _skipped(store, checkpoint_id, seen)
            if reason and spec.mode != "sync":
                return f"{checkpoint_id} was not taken: {reason}"
            if spec.mode == "sync" and (reason or time.monotonic() >= again):
                break
            time.sleep(0.2)
        if time.monotonic() >= deadline:
            return (f"{checkpoint_id} not complete after {wait_s:g} s "
                    f"({len(store.checkpoint(checkpoint_id))} of {spec.servers} shards)")


def _skipped(store: JobStore, checkpoint_id: str, after: str) -> tuple[str, str]:
    """The newest event id after `after`, and why a shard skipped `checkpoint_id` if one
    said so among those events ("" if none did)."""
    reason = ""
    for event in store.events(after=after):
        after = event.id
        if event.type == "checkpoint_skipped" and event.detail.get("checkpoint") == checkpoint_id:
            reason = str(event.detail.get("reason", ""))
    return after, reason


def _open_clock(store: JobStore, spec: JobSpec) -> int:
    beats = store.heartbeats("server", list(range(spec.servers)))
    return max((int(b.get("open_clock", 0)) for b in beats.values() if b), default=0)


def _clock_ahead(store: JobStore, spec: JobSpec) -> int:
    """A sync clock every shard has still to reach when the request arrives.

    Heartbeats report clocks up to one interval late, so aim as many clocks ahead as the
    job runs in two intervals (measured), plus two.
    """
    first = _open_clock(store, spec)
    time.sleep(spec.heartbeat_interval_s * 2)
    return clock_to_aim(first, _open_clock(store, spec))


def clock_to_aim(first: int, second: int) -> int:
    """The sync clock to cut at, from the open clock seen twice, two heartbeat intervals
    apart: past `second` by as many clocks as ran between them, plus two. Clocks that went
    back between the looks (a rollback, or a heartbeat from before one) say nothing of the
    pace: then two past `second`, never behind it (a clock already passed is skipped by
    every shard, and the request would wait for its retry in vain)."""
    return second + max(0, second - first) + 2
