"""glibc's allocator, set for training: freed buffers kept, and oneDNN's kernels packed together.

Training frees and allocates the same large buffers every step; glibc would serve them with fresh
mmap()s that page-fault every step, so ``keep_freed_buffers`` keeps them in the heap instead. oneDNN
compiles and keeps a kernel for every product shape, with ~0.6 MB of heap each: kernels built during
training land between the step's buffers and pin the heap around them, which then holds twice what
it uses. ``compact`` is where ``gemm.build_kernels`` builds them before training, all at the bottom
of the heap (benchmarks/README.md, "Memory in real training").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
_libc = None
_kept = False  # keep_freed_buffers is in force


def _glibc():
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else False
        except OSError:
            _libc = False
    return _libc or None


def keep_freed_buffers() -> bool:
    """Keep freed memory in the process instead of returning it to the OS (glibc only)."""
    global _kept
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20) == 1  # the largest glibc accepts
    ok &= libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    ok &= libc.mallopt(M_TOP_PAD, 256 * 2**20) == 1
    _kept = bool(ok)
    return _kept


@contextmanager
def compact() -> Iterator[None]:
    """Within: the heap's free memory given back first, then every buffer of 1 MiB or more from its own
    mmap() and no padding at the heap's top, so that what stays allocated (oneDNN's kernels) sits
    together at the bottom of the heap. Then the settings before (under ``keep_freed_buffers``; with
    glibc's defaults there is nothing to pack against, and nothing changes)."""
    libc = _glibc()
    if libc is None or not _kept:
        yield
        return
    libc.malloc_trim(0)
    libc.mallopt(M_TOP_PAD, 0)
    libc.mallopt(M_MMAP_THRESHOLD, 2**20)
    try:
        yield
    finally:
        keep_freed_buffers()
        libc.malloc_trim(0)
