"""Keeping torch's OpenMP threads at full speed when the model runs on a thread other than the one that loaded it.

torch's CPU kernels run on an OpenMP thread pool, and every thread that calls into torch gets a pool of its own.
GNU OpenMP (the runtime the CPU builds of torch ship) shortens its threads' busy-wait between parallel regions to
almost nothing once it manages more threads than the machine has CPUs: a pool left by the thread that loaded the
model (the main thread) and the pool of the thread that generates (a server's model worker, a web UI's handler)
are enough for that on a small machine, and every one of the thousands of small parallel regions of a decoding
step then waits for its threads to wake up. On the 2-core CPU this project measures on, the batched engine ran
about 30% slower in a worker thread than in the main thread (8 rows, 128 new tokens: 157 against 214-226
tokens/s, the process using 1.35 of its 2 cores instead of 1.99).

:func:`release_openmp_threads` frees the calling thread's pool (OpenMP 5.0 ``omp_pause_resource_all``): call it on
the thread that loaded the model before handing generation to another thread, and on a generating thread when it
is done. The pool comes back by itself the next time that thread runs torch; nothing else changes (no setting, no
result).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

import torch

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the runtime's state


@functools.cache
def _pause_function():
    """The OpenMP runtime's ``omp_pause_resource_all``, or None (looked up once)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:  # the OpenMP runtime torch loaded is in the process's global namespace
        function = getattr(ctypes.CDLL(None), "omp_pause_resource_all", None)
    except OSError:
        return None
    if function is not None:
        function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
    return function


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP thread pool (see the module docstring). Returns whether it was freed:
    False where torch does not run on OpenMP or its runtime has no ``omp_pause_resource_all``, or inside a parallel
    region (never the case between torch calls)."""
    function = _pause_function()
    if function is None:
        return False
    freed = function(OMP_PAUSE_SOFT) == 0
    logger.debug("OpenMP thread pool of %s %s", threading.current_thread().name, "freed" if freed else "kept")
    return freed
