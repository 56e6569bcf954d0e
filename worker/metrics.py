"""Prometheus metrics of a worker, served over HTTP when PSTRAIN_METRICS_PORT is set."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.errors import PSClientError

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


class _WorkerCollector(Collector):
    """Reads the worker's state when Prometheus scrapes: nothing on the training path."""

    def __init__(self, rank: int, read: Callable[[], dict[str, float]]) -> None:
        self.rank = str(rank)
        self.read = read

    def collect(self) -> Iterator[Metric]:
        values = self.read()
        for name, kind, text in (
            ("clock", "gauge", "The worker's iteration count."),
            ("samples", "counter", "Samples reported by the training script."),
            ("pushes_dropped", "counter", "Pushes the servers dropped (sync, past the quorum)."),
            ("samples_per_s", "gauge", "Recent samples per second."),
        ):
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                f"pstrain_worker_{name}", text, labels=["rank"]
            )
            family.add_metric([self.rank], values.pop(name, 0.0))
            yield family
        reported = GaugeMetricFamily("pstrain_worker_metric",
                                     "The latest value of each metric the script reported.",
                                     labels=["rank", "name"])
        for name, value in sorted(values.items()):
            reported.add_metric([self.rank, name], value)
        yield reported


class WorkerMetrics:
    """One worker's metrics. Thread-safe."""

    def __init__(self, rank: int, read: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "pstrain_client_request_seconds", "Time per data-plane call, by operation.",
            ["op"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.registry.register(_WorkerCollector(rank, read))
        self._server: Any = None

    def observe(self, what: str, seconds: float) -> None:
        """Records one call ("pull 'emb'" counts as op "pull")."""
        self.latency.labels(what.split(" ", 1)[0]).observe(seconds)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serves /metrics on `port` from a daemon thread; returns at once. PSClientError
        when the port cannot be had."""
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise PSClientError(
                f"cannot serve this worker's metrics on {host}:{port}: {exc.strerror or exc}; "
                "choose another --metrics-port (PSTRAIN_METRICS_PORT)") from exc

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
