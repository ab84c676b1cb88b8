"""Device memory accounting by storage: which storages a span of operators allocated, and how
many bytes are live at any point, op by op.

Two meters behind one interface:
- ``AllocatorMeter`` (CUDA): the caching allocator's allocated bytes, with its peak reset
  around every operator, so transients inside an op (workspaces) are seen;
- ``StorageMeter`` (any device, used on CPU): the bytes of the storages the operators
  produced that are still alive (weak references tell when they die). It sees op outputs, not
  an op's internal scratch, which on CPU kernels is small.

``OpRecorder`` is the TorchDispatchMode that drives both: every aten op passes through it, its
outputs are registered, parameter uses are noted and a callback receives (op, live before,
peak inside, live after).

The profiler (protrain/measure/profiler.py) meters its traced iteration with them; the runtime
counts the device bytes it keeps with a ``StorageMeter`` (``DeviceAccounting``, the
``"accounting"`` option) and finds saved tensors by ``storage_ptr``. A meter that shares
nothing with this count, for checking it against real allocations, is
protrain/measure/heap_peak.py.
"""
from __future__ import annotations

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
