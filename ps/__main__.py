"""`python -m ps` (and `pstrain server`): run one parameter-server shard.

This is the one place where the server reads its environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ps.errors import PSError
from ps.server import MiB, ServerConfig, run


def parse_args(argv: list[str]) -> ServerConfig:
    env = os.environ
    p = argparse.ArgumentParser(
        prog="pstrain server", description="Run one parameter-server shard."
    )
    p.add_argument("--bind", default=env.get("PSTRAIN_BIND", "0.0.0.0:7000"),
                   help="HOST:PORT to listen on; port 0 picks a free one (env PSTRAIN_BIND)")
    p.add_argument("--shard", type=int, default=int(env.get("PSTRAIN_SHARD", "0")),
                   help="this server's shard index K, 0 <= K < N (env PSTRAIN_SHARD)")
    p.add_argument("--num-shards", type=int, default=int(env.get("PSTRAIN_NUM_SHARDS", "1")),
                   help="number of shards N in the job (env PSTRAIN_NUM_SHARDS)")
    p.add_argument("--job", default=env.get("PSTRAIN_JOB", ""), help="job name (env PSTRAIN_JOB)")
    p.add_argument("--mode", default=env.get("PSTRAIN_MODE", "async"),
                   help="default consistency mode of tables: sync, ssp, ssp:S or async "
                        "(env PSTRAIN_MODE)")
    p.add_argument("--staleness", type=int, default=int(env.get("PSTRAIN_STALENESS", "0")),
                   help="ssp staleness bound S (env PSTRAIN_STALENESS)")
    p.add_argument("--workers", type=int, default=int(env.get("PSTRAIN_WORKERS", "1")),
                   help="workers in the job, backups included; ranks 0..W-1 start live "
                        "(env PSTRAIN_WORKERS)")
    p.add_argument("--backups", type=int, default=int(env.get("PSTRAIN_BACKUPS", "0")),
                   help="sync backup workers b: a clock closes with the first W - b "
                        "(env PSTRAIN_BACKUPS)")
    p.add_argument("--max-wait-s", type=float, default=300.0,
                   help="longest a pull or push waits for the clocks (default 300)")
    p.add_argument("--incarnation", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--torch-threads", type=int,
                   default=int(env.get("PSTRAIN_TORCH_THREADS", "1")),
                   help="torch intra-op threads (env PSTRAIN_TORCH_THREADS, default 1)")
    p.add_argument("--grpc-threads", type=int, default=16,
                   help="gRPC handler threads (concurrent requests served)")
    p.add_argument("--chunk-mib", type=float, default=2.0,
                   help="size of streamed chunks in MiB (default 2)")
    p.add_argument("--max-message-mib", type=float, default=64.0,
                   help="largest single gRPC message accepted, MiB (default 64)")
    p.add_argument("--max-request-mib", type=float, default=4096.0,
                   help="largest whole push accepted, MiB (default 4096)")
    p.add_argument("--ready-file", default="",
                   help="write {address, pid} as JSON here once serving")
    p.add_argument("--log-level", default=env.get("PSTRAIN_LOG_LEVEL", "INFO"),
                   help="DEBUG, INFO, WARNING or ERROR (env PSTRAIN_LOG_LEVEL)")
    a = p.parse_args(argv)
    logging.basicConfig(
        level=a.log_level.upper(),
        format=f"%(asctime)s %(levelname)s server[{a.shard}] %(name)s: %(message)s",
    )
    return ServerConfig(
        bind=a.bind, shard=a.shard, num_shards=a.num_shards, job=a.job,
        incarnation=a.incarnation, mode=a.mode, staleness=a.staleness, workers=a.workers,
        backups=a.backups, max_wait_s=a.max_wait_s, torch_threads=a.torch_threads,
        grpc_threads=a.grpc_threads, chunk_bytes=int(a.chunk_mib * MiB),
        max_message_bytes=int(a.max_message_mib * MiB),
        max_request_bytes=int(a.max_request_mib * MiB), ready_file=a.ready_file,
    )


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
        run(config)
    except PSError as exc:
        print(f"pstrain server: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
