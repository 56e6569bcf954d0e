"""The server's error rules that are pure functions."""

from __future__ import annotations

import errno

import pytest

from ps.errors import out_of_memory


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (MemoryError(), True),
        (OSError(errno.ENOMEM, "Cannot allocate memory"), True),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                      "can't allocate memory: you tried to allocate 268435456 bytes."), True),
        (OSError(errno.ENOSPC, "No space left on device"), False),
        (OSError("no errno"), False),
        (RuntimeError("shape mismatch"), False),
        (ValueError("can't allocate memory"), False),
    ],
)
def test_out_of_memory_is_only_the_os_refusing_memory(exc: BaseException, expected: bool) -> None:
    assert out_of_memory(exc) is expected
