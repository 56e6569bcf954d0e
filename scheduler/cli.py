"""The `pstrain` command line.

Roles run as their own processes: `pstrain server` replaces itself with `python -m ps`, so
the CLI never imports the server (DESIGN.md: the launcher starts roles through the CLI).
"""

from __future__ import annotations

import argparse
import os
import sys

COMMANDS = {
    "server": ("ps", "run one parameter-server shard (pstrain server --help)"),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pstrain",
        description="pstrain: a parameter-server training system for PyTorch.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parser = _parser()
    if not args or args[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        parser.error(f"unknown command {command!r}; choose one of {', '.join(COMMANDS)}")
    module = COMMANDS[command][0]
    # Replace this process so signals, exit status and pid belong to the role itself.
    os.execv(sys.executable, [sys.executable, "-m", module, *rest])
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main())
