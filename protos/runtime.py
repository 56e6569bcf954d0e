"""Process settings the data plane's speed depends on, shared by servers and workers."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
from typing import Any

MiB = 1024 * 1024
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


@functools.cache
def _glibc(function: str) -> Any:
    """The C library's `function`, or None where it has none (a libc other than glibc)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name else None
    except (OSError, AttributeError):
        return None


def tune_malloc(arenas: int = 0) -> bool:
    """Keeps multi-MiB message buffers on the heap; returns False where libc is not glibc.

    By default glibc maps every allocation over 128 KiB-32 MiB afresh and unmaps it on free,
    so each multi-MiB message costs thousands of page faults. Raising the mmap threshold to
    its maximum and the trim threshold above it lets those buffers be reused (a server
    hands them back between bursts: trim_heap). `arenas` (> 0) caps the heaps threads
    allocate from: a server takes one, the only heap whose free top trim_heap can return,
    so that its resident memory follows what its tables hold (threads rarely allocate at
    once: most of their work runs under the interpreter lock). Call it before threads
    start. Idempotent and thread-safe; affects later allocations only.
    """
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 32 * MiB)  # glibc's largest allowed value on 64-bit
    ok &= mallopt(_M_TRIM_THRESHOLD, 256 * MiB)
    if arenas > 0:
        ok &= mallopt(_M_ARENA_MAX, arenas)
    return bool(ok)


# How often a server hands the heap's free pages back to the OS (trim_heap).
TRIM_HEAP_S = 2.0


def trim_heap() -> None:
    """Hands the free pages of every heap (every thread's arena) back to the OS; a no-op
    where libc is not glibc.

    tune_malloc keeps freed multi-MiB buffers for reuse, so each handler thread's heap stays
    at the largest working set it ever served, resident and counted by no memory budget. A
    server calls this every TRIM_HEAP_S (and after moving a key index to a larger array):
    buffers are still reused within a burst of requests, and memory comes back between
    them. It cannot reach the free top of a thread's heap, which is why a table's storage is
    mapped on its own (ps.tables._storage). Blocking, outside the interpreter lock;
    thread-safe.
    """
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


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
