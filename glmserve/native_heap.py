"""Keeping the C heap's freed memory for the next step's tensors (`reuse_freed_memory`).

torch's CPU tensors come from malloc. glibc serves a request above its mmap threshold (128 KiB at first, raised
dynamically up to 32 MiB as such blocks are freed) with fresh pages that go back to the kernel when freed, and
trims free memory off the top of the heap past its trim threshold (twice the mmap threshold). Each step of a batch
allocates and frees the same large activations again (a 2,048-token chunk's gate-up output is 25 MB), so with the
dynamic thresholds some steps map them afresh and fault on every 4 KiB page on first write: 3.2 us a page on the
2-vCPU Zen 4 VM, thirty times the cost of writing it. Four mixed steps of the 64-request bench took 49K-589K page
faults from run to run; with the thresholds fixed, 49K every run (the KV pool's first touch) and the run 3-8% faster
(bench/RESULTS.md, "Peers on an AMD EPYC Zen 4 at HEAD — 2026-12-03, 14:49-15:05").

`reuse_freed_memory` fixes the mmap threshold at glibc's largest (32 MiB: blocks above it, such as a load's big
temporaries, still go back to the kernel when freed) and the trim threshold at 1 GiB: freed activations stay in the
heap. Peak RSS is the largest live set either way; the idle RSS after a burst may stay higher by what the burst
freed. Other C libraries (no `mallopt`) are left as they are; GLMSERVE_HEAP_REUSE=0 turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os

HEAP_REUSE_ENV = "GLMSERVE_HEAP_REUSE"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest accepted value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 1 << 30


@functools.cache
def reuse_freed_memory() -> bool:
    """Sets glibc's mmap and trim thresholds once per process; True where they were set."""
    if os.environ.get(HEAP_REUSE_ENV) == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its own policy stays
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(option, value) == 1 for option, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                                                                  (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)))
