"""A worker that moves 4 MiB pushes and pulls through a forced transport until it is killed.

    python tests/transport_worker.py ADDRESS TRANSPORT

Prints "looping" once the first round trip is done. Used by the tests that kill a process
mid-transfer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.client import PSClient


def main() -> None:
    address, transport = sys.argv[1], sys.argv[2]
    with PSClient([address], worker=5, transport=transport) as client:
        client.declare_dense("loop", (1024, 1024), optimizer="sgd", lr=1e-6)
        grad = torch.ones(1024, 1024)
        client.push_dense("loop", grad)
        client.pull_dense("loop")
        print("looping", client.transports(), flush=True)
        for _ in range(1_000_000):
            client.push_dense("loop", grad)
            client.pull_dense("loop")


if __name__ == "__main__":
    main()
