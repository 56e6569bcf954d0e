"""`pstrain`'s entry point. A server-side subcommand replaces this process with its own module
before anything else is imported (the CLI's modules, grpc and redis cost a server start about
a third of a second); every other subcommand runs in scheduler/cli.py.

Server-side code runs as its own process (`python -m ps`, `ps.export`, `ps.plan`): exec
replaces this one, so signals, exit status and pid belong to it, and the CLI never imports
the server (DESIGN.md: the CLI imports only protos and scheduler).
"""

from __future__ import annotations

import os
import sys

# Subcommands that are server-side code, and the module each runs as.
SERVER_SIDE = {"server": "ps", "export": "ps.export", "plan": "ps.plan"}


def exec_server_side(args: list[str]) -> None:
    """Replaces this process with the module of a server-side subcommand; returns for any
    other."""
    if args and args[0] in SERVER_SIDE:
        os.execv(sys.executable, [sys.executable, "-m", SERVER_SIDE[args[0]], *args[1:]])


def main() -> int:
    args = sys.argv[1:]
    exec_server_side(args)
    from scheduler.cli import main as cli_main  # noqa: PLC0415 (after the exec, on purpose)

    return cli_main(args)


if __name__ == "__main__":  # `python -m scheduler.entry ...`: what the `pstrain` script runs
    sys.exit(main())
