"""The C allocator's mmap threshold, fixed for a run's processes (glibc; elsewhere nothing).

A block above glibc's mmap threshold is an ``mmap`` of its own, given back to the system when
freed; anything below comes from the heap, which keeps what it grew to. The threshold starts
at 128 KiB and, by default, rises to the size of every mmapped block freed (up to 32 MiB).
Both hurt a crawl:

* asyncio's selector transport reads with ``sock.recv(256 KiB)``: a 256 KiB buffer for every
  read, shrunk to what arrived. Under a 128 KiB threshold that is an ``mmap``, an ``mremap``
  and a ``munmap`` for every response (python/cpython#85451; ~18 us of CPU a request,
  ``bench/throughput.py``).
* Once a body of 1 MiB or 8 MiB (``max_body_bytes``) was freed, the threshold rose to it and
  every later body came from the heap, which fragmented and never shrank: a crawl of 1 MB
  payloads grew the run to ~1 GB and its writing process to ~3 GB over 3,000 IDs (a resources
  audit, stop 52).

So the threshold is set, once, to ``THRESHOLD`` (``mallopt``, which also stops it moving):
reads stay on the heap, bodies above it are mmaps again, whatever came before. Process-wide;
not done where the environment set glibc's thresholds itself (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``), nor where there is no ``mallopt``: there,
freeing one mmapped block of ``THRESHOLD`` bytes still lifts the threshold above the reads.
"""

from __future__ import annotations

import os
import sys

THRESHOLD = 384 * 1024  # bytes: above asyncio's 256 KiB reads, below glibc's cap (512 KiB on 32-bit)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt(3)'s parameters
_done = False


def fix_mmap_threshold() -> None:
    """Set the C allocator's mmap threshold to ``THRESHOLD`` (and its trim threshold to twice
    that, as the dynamic threshold would), once per process."""
    global _done
    if _done:
        return
    _done = True
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                                           "GLIBC_TUNABLES")):
        return  # (the operator's choice)
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            mallopt = None
        if mallopt is not None:
            mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
            mallopt.restype = ctypes.c_int
            if mallopt(_M_MMAP_THRESHOLD, THRESHOLD) == 1:
                mallopt(_M_TRIM_THRESHOLD, 2 * THRESHOLD)
                return
    block = bytes(THRESHOLD)  # (no mallopt: glibc's dynamic threshold rises to it when freed)
    del block
