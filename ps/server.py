"""The parameter-server process: one shard served over gRPC, with the standard health service."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from types import FrameType

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import rpc
from protos.modes import ASYNC, Mode
from protos.runtime import TRIM_HEAP_S, trim_heap, tune_malloc
from protos.security import Security
from protos.transport import TransportError, parse_choice
from ps.auth import Gatekeeper
from ps.bulk import BulkEndpoint
from ps.checkpoint import load_checkpoint
from ps.clocks import Quorum
from ps.concurrency import CallGate, CallLimits
from ps.errors import InvalidArgumentError
from ps.limits import Limits, MiB
from ps.metrics import ServerMetrics
from ps.servicer import ParameterServerServicer, WireLimits
from ps.shard import Shard, ShardConfig

log = logging.getLogger(__name__)

VERSION = "0.1.0"


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server process needs; validated on construction."""

    bind: str
    shard: int = 0
    num_shards: int = 1
    job: str = ""
    incarnation: int = 1
    mode: Mode = ASYNC  # of tables declared without a mode of their own
    staleness: int = 0  # the default ssp bound
    workers: int = 1
    backups: int = 0
    max_wait_s: float = 300.0
    torch_threads: int = 1
    grpc_threads: int = 16  # RESERVED_THREADS of them for health and admin calls only
    max_client_calls: int = 8  # data calls one client may have in flight
    chunk_bytes: int = 2 * MiB
    max_message_bytes: int = 64 * MiB
    max_request_bytes: int = 4096 * MiB
    stream_idle_s: float = 60.0
    ready_file: str = ""
    grace_s: float = 2.0
    metrics_port: int = 0  # 0: no metrics
    transport: str = "auto"  # bulk transport: auto, or one of protos.transport.PREFERENCE
    limits: Limits = field(default_factory=Limits)
    checkpoint_dir: str = ""  # where Restore finds checkpoints by id ("" : it cannot)
    checkpoint_full_every: int = 1  # a full snapshot every this many, the others deltas
    security: Security = field(default_factory=Security)  # TLS and the job secret, when on

    def __post_init__(self) -> None:
        host, sep, port = self.bind.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidArgumentError(
                f"--bind must be HOST:PORT (e.g. 0.0.0.0:7000, or port 0 for any), "
                f"got {self.bind!r}"
            )
        if self.stream_idle_s <= 0:
            raise InvalidArgumentError(f"--stream-idle-s must be > 0, got {self.stream_idle_s}")
        for name in ("torch_threads", "grpc_threads", "chunk_bytes", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.call_limits()  # checks --grpc-threads and --max-client-calls
        try:
            parse_choice(self.transport)
        except TransportError as exc:
            raise InvalidArgumentError(f"--transport: {exc}") from exc
        if self.chunk_bytes + MiB > self.max_message_bytes:
            raise InvalidArgumentError(
                f"chunk_bytes ({self.chunk_bytes}) must leave 1 MiB of headroom under "
                f"max_message_bytes ({self.max_message_bytes})"
            )

    def call_limits(self) -> CallLimits:
        return CallLimits.for_threads(self.grpc_threads, self.max_client_calls)

    def shard_config(self) -> ShardConfig:
        return ShardConfig(
            shard=self.shard, num_shards=self.num_shards, job=self.job,
            incarnation=self.incarnation, mode=self.mode, staleness=self.staleness,
            quorum=Quorum(self.workers, self.backups), max_wait_s=self.max_wait_s,
            limits=self.limits, checkpoint_full_every=self.checkpoint_full_every,
        )


def _describe(security: Security) -> str:
    tls = "TLS with client certificates" if security.tls else "no TLS"
    return f"{tls}, {'a job secret' if security.secret else 'no job secret'}"


def tune_process(torch_threads: int) -> None:
    """Process-wide settings that the data plane's speed depends on.

    One torch thread per process: on small machines a second thread collapses throughput
    whenever another process holds a core. One heap for every thread, handed back to the OS
    every TRIM_HEAP_S (protos.runtime).
    """
    torch.set_num_threads(torch_threads)
    tune_malloc(arenas=1)


class ParameterServer:
    """A running server. `start` returns once it listens; `wait` blocks until it stops."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.shard = Shard(config.shard_config())
        self.bulk = BulkEndpoint(parse_choice(config.transport), config.shard)
        self.servicer = ParameterServerServicer(
            self.shard,
            WireLimits(config.chunk_bytes, config.max_message_bytes, config.max_request_bytes,
                       config.stream_idle_s),
            VERSION,
            lambda checkpoint_id, sha256: load_checkpoint(
                config.checkpoint_dir, config.job, checkpoint_id, config.shard,
                config.num_shards, sha256),
            self.bulk, CallGate(config.call_limits()), config.security.tls,
        )
        # Runs gRPC's calls and the request lanes' alike: one thread limit for both.
        self._calls = futures.ThreadPoolExecutor(
            max_workers=config.grpc_threads, thread_name_prefix=f"shard{config.shard}"
        )
        self._grpc = grpc.server(
            self._calls,
            interceptors=[Gatekeeper(config.security)] if config.security.enabled else [],
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        if config.metrics_port:
            self.metrics = ServerMetrics(
                self.shard, lambda: (self.servicer.bytes.received, self.servicer.bytes.sent)
            )
            self.servicer.latency = self.metrics.latency
            self.shard.observe_staleness = (
                lambda table, clocks: self.metrics.staleness.labels(table).observe(clocks)
            )
        self._grpc.add_generic_rpc_handlers(self.servicer.handlers())
        self.bulk.serve_lanes(self.servicer.lane_handler(), config.max_message_bytes,
                              self._calls, config.grpc_threads)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        self.port = 0
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        host = self.config.bind.rpartition(":")[0]
        return f"{host}:{self.port}"

    def start(self) -> None:
        """Binds and starts serving. Raises InvalidArgumentError if the address is taken."""
        try:
            self.port = self.config.security.add_port(self._grpc, self.config.bind)
        except RuntimeError as exc:
            raise InvalidArgumentError(f"cannot bind {self.config.bind}: {exc}") from exc
        if self.port == 0:
            raise InvalidArgumentError(
                f"cannot bind {self.config.bind}: the address is in use or not local"
            )
        self._grpc.start()
        threading.Thread(target=self._trim_heap, name=f"shard{self.config.shard}-trim",
                         daemon=True).start()
        if self.config.metrics_port:
            # Where the server listens, and nowhere else: a server bound to loopback does not
            # show its tables' names and sizes to the network.
            host = self.config.bind.rpartition(":")[0].strip("[]")
            self.metrics.serve(self.config.metrics_port, host)
            log.info("shard %d: metrics on %s:%d/metrics", self.config.shard, host,
                     self.config.metrics_port)
        for service in ("", rpc.SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "shard %d/%d serving on %s (incarnation %d, mode %s, %s)", self.config.shard,
            self.config.num_shards, self.address, self.config.incarnation,
            self.config.mode.with_default(self.config.staleness),
            _describe(self.config.security),
        )
        if self.config.ready_file:
            tmp = self.config.ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"address": self.address, "pid": os.getpid()}, f)
            os.replace(tmp, self.config.ready_file)

    def stop(self, grace_s: float | None = None) -> None:
        """Stops serving; in-flight calls get `grace_s` to finish. Thread-safe, idempotent."""
        grace = self.config.grace_s if grace_s is None else grace_s
        self.health.enter_graceful_shutdown()
        stopped = self._grpc.stop(grace)
        self.bulk.close_lanes(grace)
        stopped.wait()
        self.bulk.close()
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()

    def _trim_heap(self) -> None:
        """Until stopped: the heap's free pages go back to the OS every TRIM_HEAP_S."""
        while not self._stopped.wait(TRIM_HEAP_S):
            trim_heap()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until stopped (or the timeout); True if stopped."""
        return self._stopped.wait(timeout_s)


def run(
    config: ServerConfig,
    attach: Callable[[ParameterServer], Callable[[], None]] | None = None,
    prepare: Callable[[ParameterServer], None] | None = None,
) -> None:
    """Serves until SIGTERM or SIGINT. Blocks.

    `prepare` runs before the server listens (restoring a checkpoint); `attach` once it
    listens (registering it in a job), and the function it returns on the way out.
    """
    tune_process(config.torch_threads)
    server = ParameterServer(config)
    if prepare is not None:
        prepare(server)
    server.start()
    detach = attach(server) if attach is not None else None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("shard %d: signal %d, stopping", config.shard, signum)
        threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.wait()
    finally:
        if detach is not None:
            detach()
