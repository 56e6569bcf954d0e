"""The `ucx` transport: bulk payloads over UCX through the `ucxx` package (pstrain[ucx]).

UCX picks RDMA (verbs) when the host's UCX library has it and the hardware exists, else TCP
or shared memory.
"""

from __future__ import annotations

import importlib.util


def probe() -> tuple[bool, str]:
    """Whether UCX can work here, and why not."""
    if importlib.util.find_spec("ucxx") is None:
        return False, "the ucxx package is not installed (pip install 'pstrain[ucx]')"
    return False, "the ucx transport is not built yet in this version"
