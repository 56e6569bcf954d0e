"""Process settings the data plane's speed depends on, shared by servers and workers."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

MiB = 1024 * 1024
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc() -> bool:
    """Keeps multi-MiB message buffers on the heap; returns False where libc is not glibc.

    By default glibc maps every allocation over 128 KiB-32 MiB afresh and unmaps it on free,
    so each multi-MiB message costs thousands of page faults. Raising the mmap threshold to
    its maximum and the trim threshold above it lets those buffers be reused. Idempotent and
    thread-safe; affects later allocations only.
    """
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 32 * MiB)  # glibc's largest allowed value on 64-bit
    ok &= mallopt(_M_TRIM_THRESHOLD, 256 * MiB)
    return bool(ok)


# The nice value background work runs at: the kernel gives it the CPU time the threads that
# serve requests leave over.
BACKGROUND_NICE = 19


def run_in_background() -> bool:
    """Lowers the calling thread's CPU priority to nice BACKGROUND_NICE (threads it starts
    from then on inherit it); returns False where the OS has no per-thread priority.

    For long work beside serving, such as writing a checkpoint: on a machine whose cores
    are busy with training, the write then takes the time the training leaves, instead of
    slowing its steps. Only the calling thread changes; it cannot raise its priority again.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        return False
    return True
