"""HeapPeak: the peak of the bytes the process's allocator has handed out over a span, for
tests and benchmarks that check the memory model and the runtime's storage count
(protrain/runtime/meter.py) against real allocations. It shares nothing with that count:
glibc ``mallinfo2`` sampled after every operator on CPU, the CUDA caching allocator's
``max_memory_allocated`` on CUDA. It sees what the storage count does not: the allocator's
rounding and headers, and scratch memory an operator allocates and frees internally (at least
what is still held when the operator returns).
"""
from __future__ import annotations

import ctypes

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def heap_bytes() -> int | None:
    """Bytes glibc's malloc has handed out and not taken back: chunks in use in its arenas
    (``uordblks``) plus the chunks it mmapped for large requests (``hblkhd``), headers and
    rounding included. None without glibc >= 2.33 (no ``mallinfo2``)."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


class HeapPeak(TorchDispatchMode):
    """Peak of the allocator's bytes in use above the level at ``__enter__``.

    CPU: ``heap_bytes()`` read after every operator while ``sampling``. This counts
    the whole process (Python objects that malloc, other threads), so keep other work out of
    the measured span. CUDA: ``torch.cuda.max_memory_allocated`` (the caching allocator's
    exact peak, transients inside kernels' workspaces included), no per-op sampling needed.
    Dispatch modes nest last-in first-out: a mode entered inside (the runtime's accounting)
    must be left before this one exits; ``stop()`` ends the measured span earlier."""

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__()
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if not self.cuda and _MALLINFO2 is None:
            raise RuntimeError("HeapPeak on CPU needs glibc's mallinfo2 (glibc >= 2.33); this "
                               "process has none")
        self.base = 0
        self.top = 0
        self.sampling = True

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = self.top = heap_bytes()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.sampling and not self.cuda:
            # After the op: its outputs exist and its inputs are still referenced, the highest
            # point between two ops (an op's internal scratch is freed by then unless kept).
            self.top = max(self.top, heap_bytes())
        return out

    def stop(self) -> None:
        """Stop sampling (the mode stays on the stack until ``__exit__``)."""
        if self.cuda and self.sampling:
            torch.cuda.synchronize(self.device)
            self.top = torch.cuda.max_memory_allocated(self.device)
        self.sampling = False

    @property
    def peak(self) -> int:
        """Highest bytes in use above the level at entry."""
        if self.cuda and self.sampling:
            torch.cuda.synchronize(self.device)
            self.top = torch.cuda.max_memory_allocated(self.device)
        return max(self.top - self.base, 0)
