"""The C allocator, tuned for a process that streams large reads (the data plane).

uvloop hands each read to Python as a new ``bytes`` of up to 256 KiB, and glibc's malloc serves a
request that large with a fresh ``mmap`` (its threshold starts at 128 KiB) and returns it with
``munmap`` when the bytes is freed: every read of a large upload or download then page-faults in
and zeroes 64 new pages. Measured on a 1 GiB upload through the router: ~25,000 minor faults per
GiB, a tenth of the process's CPU in the kernel's page-fault path (docs/performance.md). Served
from the heap instead, the same memory is reused read after read.

Bounds, so that memory stays constant: chunks up to ``MMAP_THRESHOLD`` come from the heap, and
the heap gives memory back to the system once more than ``TRIM_THRESHOLD`` is free at its top.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from twisted.logger import Logger

_log = Logger(namespace="lchat.malloc")

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 4 * 1024 * 1024  # reads are at most 256 KiB; a body chunk no more than that
TRIM_THRESHOLD = 16 * 1024 * 1024  # free memory the heap may keep


def tune_for_streaming() -> bool:
    """Apply the thresholds above to this process's glibc malloc; False (and nothing changed)
    where the C library is not glibc or refuses them."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt)
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not done:
        _log.warn("malloc thresholds not applied: large reads will be mmapped each time")
    return done
