"""Device memory accounting for the profiler: which storages the traced iteration allocated,
and how many bytes are live at any point, op by op.

Two meters behind one interface:
- ``AllocatorMeter`` (CUDA): the caching allocator's allocated bytes, with its peak reset
  around every operator, so transients inside an op (workspaces) are seen;
- ``StorageMeter`` (any device, used on CPU): the bytes of the storages the operators
  produced that are still alive (weak references tell when they die). It sees op outputs, not
  an op's internal scratch, which on CPU kernels is small.

``OpRecorder`` is the TorchDispatchMode that drives both: every aten op passes through it, its
outputs are registered, parameter uses are noted and a callback receives (op, live before,
peak inside, live after).

``HeapPeak`` is a second meter that shares nothing with the storage counter, for tests and
benchmarks that check the memory model against real allocations: the bytes the process's
allocator has handed out (glibc ``mallinfo2`` sampled after every operator on CPU; the CUDA
caching allocator's ``max_memory_allocated`` on CUDA). It sees what the storage counter does
not: the allocator's rounding and headers, and scratch memory an operator allocates and frees
internally (at least what is still held when the operator returns).
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class StorageRegistry:
    """Storages created on ``device_type`` while recording, and their live bytes."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.live_bytes = 0
        self._alive: dict[int, tuple[weakref.ref, int]] = {}
        self.paused = False

    def register(self, t: torch.Tensor) -> None:
        if self.paused or t.device.type != self.device_type or storage_ptr(t) in (None, 0):
            return
        st = t.untyped_storage()
        ptr = st.data_ptr()
        known = self._alive.get(ptr)
        if known is not None and known[0]() is st:
            return
        nbytes = st.nbytes()
        if known is not None:  # a dead storage whose callback has not run yet
            self.live_bytes -= known[1]
        self._alive[ptr] = (weakref.ref(st, self._make_callback(ptr)), nbytes)
        self.live_bytes += nbytes

    def _make_callback(self, ptr: int):
        def freed(ref, ptr=ptr, registry=weakref.ref(self)):
            reg = registry()
            if reg is None:
                return
            entry = reg._alive.get(ptr)
            if entry is not None and entry[0] is ref:
                del reg._alive[ptr]
                reg.live_bytes -= entry[1]
        return freed

    def contains(self, t: torch.Tensor) -> bool:
        if storage_ptr(t) is None:
            return False
        st = t.untyped_storage()
        entry = self._alive.get(st.data_ptr())
        return entry is not None and entry[0]() is st


class StorageMeter:
    """Live bytes = registered storages still alive."""

    def __init__(self, registry: StorageRegistry):
        self.registry = registry

    def live(self) -> int:
        return self.registry.live_bytes

    def op_begin(self) -> None:
        pass

    def op_peak(self, before: int) -> int:
        return max(before, self.registry.live_bytes)

    def exclude(self, nbytes: int) -> None:  # storages it does not register need no exclusion
        pass


class AllocatorMeter:
    """Live bytes = CUDA allocated bytes - what was there at start - excluded (streamed params)."""

    def __init__(self, device: torch.device):
        self.device = device
        torch.cuda.synchronize(device)
        self.base = torch.cuda.memory_allocated(device)
        self.excluded = 0

    def live(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.base - self.excluded

    def op_begin(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def op_peak(self, before: int) -> int:
        return max(before, torch.cuda.max_memory_allocated(self.device) - self.base - self.excluded)

    def exclude(self, nbytes: int) -> None:
        self.excluded += nbytes


def storage_ptr(t: torch.Tensor) -> int | None:
    """Address of a tensor's storage (None for tensors without one: sparse, meta, nested)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


OpCallback = Callable[[str, int, int, int], None]


class OpRecorder(TorchDispatchMode):
    """Registers every op's outputs, reports memory around each op, notes parameter uses."""

    def __init__(self, registry: StorageRegistry, meter, on_op: OpCallback,
                 param_of_ptr: dict[int, int], on_param_use: Callable[[int], None]):
        super().__init__()
        self.registry = registry
        self.meter = meter
        self.on_op = on_op
        self.param_of_ptr = param_of_ptr
        self.on_param_use = on_param_use

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.registry.paused:
            return func(*args, **kwargs)
        flat_in, _ = tree_flatten((args, kwargs))
        inputs = dict.fromkeys(storage_ptr(a) for a in flat_in if isinstance(a, torch.Tensor))
        for ptr in inputs:
            idx = self.param_of_ptr.get(ptr)
            if idx is not None:
                self.on_param_use(idx)
        before = self.meter.live()
        self.meter.op_begin()
        out = func(*args, **kwargs)
        flat_out, _ = tree_flatten(out)
        # Views and in-place results share an input's storage: not a new allocation (and a
        # parameter's storage, seen through weight.t(), must never count as activation).
        for t in flat_out:
            if isinstance(t, torch.Tensor) and storage_ptr(t) not in inputs:
                self.registry.register(t)
        peak = self.meter.op_peak(before)
        self.on_op(func.__name__, before, peak, self.meter.live())
        return out


# ---- the second meter: real allocator bytes -----------------------------------------------
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
