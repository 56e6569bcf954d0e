"""protos.runtime: the process settings servers and workers share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from protos.runtime import trim_heap, tune_malloc

MiB = 1 << 20


def resident() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_freed_buffers_stay_resident_until_the_heap_is_trimmed() -> None:
    if not tune_malloc():
        pytest.skip("libc is not glibc")
    blocks = [np.ones(MiB // 8) for _ in range(64)]  # 64 MiB of 1 MiB blocks, on the heap
    held = resident()
    del blocks
    kept = resident()
    assert held - kept < 16 * MiB  # freed, yet kept for reuse (tune_malloc)
    trim_heap()
    assert kept - resident() >= 48 * MiB
