"""Prometheus metrics of a server, served over HTTP on --metrics-port.

Table sizes and traffic counters are read from the shard when Prometheus scrapes, so the
data plane pays nothing for them; only request latencies and pull staleness are observed
per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ps.errors import InvalidArgumentError
from ps.shard import Shard

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


class _ShardCollector(Collector):
    """Reads the shard's counters at scrape time."""

    def __init__(self, shard: Shard, traffic: Callable[[], tuple[int, int]]) -> None:
        self.shard = shard
        self.traffic = traffic

    def collect(self) -> Iterator[Metric]:
        labels = ["shard"]
        shard_label = str(self.shard.config.shard)
        rows = GaugeMetricFamily("pstrain_table_rows", "Rows a table holds on this shard.",
                                 labels=[*labels, "table"])
        size = GaugeMetricFamily("pstrain_table_bytes",
                                 "Bytes of values, optimizer state and index of a table.",
                                 labels=[*labels, "table"])
        parts = GaugeMetricFamily(
            "pstrain_table_part_bytes",
            "Bytes of a table by part: value, state, index, metadata (admission sketch, row "
            "stamps, evicted-id bits), memory (all of it at reserved capacity, as "
            "--memory-budget counts it).", labels=[*labels, "table", "part"])
        counters = {
            name: CounterMetricFamily(f"pstrain_table_{name}", text, labels=[*labels, "table"])
            for name, text in (
                ("pushes_applied", "Pushes applied to a table."),
                ("pushes_duplicate", "Retried pushes acknowledged without applying again."),
                ("pushes_rejected", "Pushes refused for bad input."),
                ("pushes_dropped", "Sync gradients past their clock's quorum (backups)."),
                ("pulls", "Pulls served from a table."),
                ("rows_pulled", "Rows served by pulls."),
                ("rows_pushed", "Rows updated by pushes."),
                ("admitted", "Ids given a row."),
                ("refused_by_admission", "Keys refused a row by the admission rule: pulls "
                 "served the default row, gradients dropped."),
                ("evicted", "Rows evicted by TTL or max_rows."),
                ("readmitted", "Rows created for ids evicted before (estimated)."),
            )
        }
        for stats, _mode in self.shard.stats():
            key = [shard_label, stats.name]
            rows.add_metric(key, stats.rows)
            size.add_metric(key, stats.value_bytes + stats.state_bytes + stats.index_bytes)
            for part, nbytes in (("value", stats.value_bytes), ("state", stats.state_bytes),
                                 ("index", stats.index_bytes),
                                 ("metadata", stats.metadata_bytes),
                                 ("memory", stats.memory_bytes)):
                parts.add_metric([*key, part], nbytes)
            for name, family in counters.items():
                family.add_metric(key, getattr(stats.counters, name))
        yield rows
        yield size
        yield parts
        yield from counters.values()
        state = self.shard.clock_state()
        clock = GaugeMetricFamily("pstrain_open_clock", "The oldest sync clock still open.",
                                  labels=labels)
        clock.add_metric([shard_label], state.open_clock)
        yield clock
        closed = CounterMetricFamily("pstrain_clocks_closed", "Sync clocks closed.",
                                     labels=labels)
        closed.add_metric([shard_label], state.clocks_closed)
        yield closed
        writes = self.shard.snapshots.counts()
        written = CounterMetricFamily(
            "pstrain_checkpoints_written", "Checkpoint shard files this server wrote, by kind.",
            labels=[*labels, "kind"])
        written.add_metric([shard_label, "full"], writes.full)
        written.add_metric([shard_label, "delta"], writes.delta)
        yield written
        failed = CounterMetricFamily(
            "pstrain_checkpoints_failed",
            "Checkpoint writes of this server that failed (training went on).", labels=labels)
        failed.add_metric([shard_label], writes.failed)
        yield failed
        files = CounterMetricFamily("pstrain_checkpoint_bytes",
                                    "Bytes of the checkpoint files this server wrote.",
                                    labels=labels)
        files.add_metric([shard_label], writes.nbytes)
        yield files
        last = GaugeMetricFamily(
            "pstrain_checkpoint_last_written_timestamp_seconds",
            "When this server last wrote a checkpoint file (Unix time; 0: never).",
            labels=labels)
        last.add_metric([shard_label], writes.last_written_s)
        yield last
        received, sent = self.traffic()
        traffic = CounterMetricFamily("pstrain_server_bytes", "Payload bytes by direction.",
                                      labels=[*labels, "direction"])
        traffic.add_metric([shard_label, "received"], received)
        traffic.add_metric([shard_label, "sent"], sent)
        yield traffic


class ServerMetrics:
    """The metrics of one server process. Thread-safe (prometheus_client locks)."""

    def __init__(self, shard: Shard, traffic: Callable[[], tuple[int, int]]) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "pstrain_request_seconds", "Server time per request, by method.", ["method"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.staleness = Histogram(
            "pstrain_pull_staleness_clocks",
            "Clocks between a pull's clock and the slowest live worker's when it was served.",
            ["table"], buckets=STALENESS_BUCKETS, registry=self.registry,
        )
        self.registry.register(_ShardCollector(shard, traffic))

    def serve(self, port: int, host: str) -> None:
        """Serves /metrics on `host`:`port` from a daemon thread; returns at once.
        InvalidArgumentError when the port cannot be had."""
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise InvalidArgumentError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; choose another "
                "--metrics-port") from exc
