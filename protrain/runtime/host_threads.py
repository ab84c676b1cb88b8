"""The OpenMP threads of the calling thread's host work (CPU Adam, the passes around it).

OpenMP keeps the thread count of a parallel region per calling thread (its nthreads ICV): a
kernel without a ``num_threads`` clause - DeepSpeed's CPU Adam, torch's elementwise ops - forks
as many threads as the thread that calls it is set to, and a new thread starts from
OMP_NUM_THREADS (torchrun sets 1 for more than one rank per node) or all the cores. So the
rank's share of the node's cores (``runtime.node.NodeShare.threads``) is set on the thread that
runs the host work: for a call (``omp_threads``) where it shares its thread with the training
loop, whose count is put back after; for good on the host worker thread, which does nothing
else. ProTrain's own kernel takes the count as an argument.

Set through the OpenMP runtime torch loaded (``omp_set_num_threads`` of the process), not
``torch.set_num_threads``: torch's also changes the count every thread created later starts
with, and MKL's - the training threads' settings.
"""
from __future__ import annotations

import ctypes
from contextlib import contextmanager

_omp = None


def _runtime():
    """(omp_get_max_threads, omp_set_num_threads) of the OpenMP runtime in the process, or None
    (torch built without OpenMP: nothing to set)."""
    global _omp
    if _omp is None:
        import torch  # noqa: F401 - loads the OpenMP runtime (global symbols) first
        try:
            lib = ctypes.CDLL(None)
            get, put = lib.omp_get_max_threads, lib.omp_set_num_threads
            get.restype, get.argtypes = ctypes.c_int, []
            put.restype, put.argtypes = None, [ctypes.c_int]
            _omp = (get, put)
        except (AttributeError, OSError):
            _omp = False
    return _omp or None


def thread_count() -> int:
    """OpenMP threads a parallel region started on this thread now gets."""
    rt = _runtime()
    if rt is None:
        import torch
        return torch.get_num_threads()
    return int(rt[0]())


def set_thread_count(n: int) -> None:
    """OpenMP threads of the parallel regions this thread starts from now on.

    torch initialises each thread's count lazily, at the thread's first parallel region, to
    its global setting: set before that (a new worker thread's first act), the count was
    overwritten by the first large copy (issue 35: the CPU Adam worker's passes ran on the
    wrong count). ``torch.get_num_threads()`` runs that initialisation first."""
    rt = _runtime()
    if rt is not None and n >= 1:
        import torch
        torch.get_num_threads()
        rt[1](int(n))


@contextmanager
def omp_threads(n: int | None):
    """``n`` OpenMP threads for the parallel regions this thread starts inside the block; the
    count it had is put back after. None or 0: unchanged."""
    if not n:
        yield
        return
    before = thread_count()
    if before == n:
        yield
        return
    set_thread_count(n)
    try:
        yield
    finally:
        set_thread_count(before)
