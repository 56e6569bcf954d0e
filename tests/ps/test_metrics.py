"""Prometheus metrics of a real server process and of a worker, scraped over HTTP."""

from __future__ import annotations

import re
import socket

import numpy as np
import pytest
import torch
from procs import Procs, free_port
from scrape import scrape, value

import worker
from worker.errors import PSClientError


def test_server_and_worker_metrics(procs: Procs) -> None:
    server_port, worker_port = free_port(), free_port()
    server = procs.server(extra=["--metrics-port", str(server_port), "--mode", "ssp"])
    ctx = worker.init(env={"PSTRAIN_SERVERS": server.address,
                           "PSTRAIN_METRICS_PORT": str(worker_port)})
    try:
        client = ctx.client
        client.declare_sparse("emb", 8, optimizer="sgd", lr=0.1)
        keys = np.arange(100, dtype=np.int64)
        for _ in range(3):
            client.pull_sparse("emb", keys)
            client.push_sparse("emb", keys, torch.ones(100, 8))
            client.end_iteration()
            ctx.report(samples=32, loss=0.25)
        text = scrape(server_port)
        assert value(text, "pstrain_table_rows", table="emb") == 100
        assert value(text, "pstrain_table_pushes_applied_total", table="emb") == 3
        assert value(text, "pstrain_table_admitted_total", table="emb") == 100
        assert value(text, "pstrain_table_evicted_total", table="emb") == 0
        assert value(text, "pstrain_table_part_bytes", table="emb", part="value") == 100 * 8 * 4
        # Every pull, push and end of iteration is an exchange (over the lane, where shm
        # works, timed alike).
        assert value(text, "pstrain_request_seconds_count", method="Exchange") == 9
        assert value(text, "pstrain_pull_staleness_clocks_count", table="emb") == 3
        assert value(text, "pstrain_server_bytes_total", direction="received") > 3 * 100 * 8 * 4
        assert value(text, "pstrain_open_clock") == 3
        mine = scrape(worker_port)
        assert value(mine, "pstrain_worker_samples_total") == 96
        assert value(mine, "pstrain_worker_clock") == 3
        assert value(mine, "pstrain_worker_metric", name="loss") == 0.25
        assert value(mine, "pstrain_client_request_seconds_count", op="pull") == 3
        assert re.search(r'pstrain_worker_pushes_dropped_total\{rank="0"\} 0', mine)
    finally:
        ctx.close()


def listening_hosts(port: int) -> set[str]:
    """The IPv4 addresses some socket of this host listens on at `port` (/proc/net/tcp)."""
    hosts = set()
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                hosts.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return hosts


def test_metrics_listen_where_the_server_binds(procs: Procs) -> None:
    port = free_port()
    procs.server(extra=["--metrics-port", str(port)])  # bound to 127.0.0.1
    assert listening_hosts(port) == {"127.0.0.1"}
    assert "pstrain_open_clock" in scrape(port)


def test_a_worker_metrics_port_in_use_is_named(procs: Procs) -> None:
    server = procs.server()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PSClientError, match=f"cannot serve this worker's metrics on "
                                                f"0.0.0.0:{port}: Address already in use"):
            worker.init(env={"PSTRAIN_SERVERS": server.address,
                             "PSTRAIN_METRICS_PORT": str(port)})
