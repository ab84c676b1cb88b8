"""What the profiler measures about attention, per part: the time inside the attention
operator (forward and backward), the bytes its inputs and output span, the head counts, and
the bytes the selective mode would keep.

These let one profile serve other sequence lengths and sequence-parallel degrees
(protrain.sp.scaling: attention grows with s^2, the rest with s; Ulysses' all-to-alls move
the attention operator's inputs and output) and the selective block mode
(BlockMode.SELECTIVE keeps the outputs of the operators protrain.runtime.selective names).

- ``AttentionTimer`` (timing pass): a TorchFunctionMode around
  ``torch.nn.functional.scaled_dot_product_attention``; forward time between marks around the
  call, backward time between a gradient hook on its output (its backward is next) and one on
  its query (its backward produced that gradient). Marks are the tracer's clock (CUDA events
  or perf_counter), so nothing synchronises.
- ``KeptBytes`` (memory pass): a TorchDispatchMode that adds up, per part, the distinct
  storages produced by the operators a SELECTIVE block keeps.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..runtime.selective import is_kept

State = Callable[[], tuple[str, int]]
"""Returns the tracer's (phase, part)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class AttentionTimer(TorchFunctionMode):
    def __init__(self, clock, state: State):
        super().__init__()
        self.clock = clock
        self.state = state
        self.fwd_marks: list[tuple[int, object, object]] = []     # (part, start, end)
        self.bwd_marks: dict[int, list] = {}                      # call -> [part, start, end]
        self.io_bytes: dict[int, int] = defaultdict(int)
        self.heads = 0
        self.kv_heads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        phase, part = self.state()
        q, k, v = args[:3]
        if phase == "fwd" and q.dim() == 4:
            self.heads, self.kv_heads = int(q.shape[1]), int(k.shape[1])
        start = self.clock.mark()
        out = func(*args, **kwargs)
        end = self.clock.mark()
        if phase != "fwd":
            return out                      # a recompute in backward: not the forward's time
        self.fwd_marks.append((part, start, end))
        self.io_bytes[part] += _nbytes(q) + _nbytes(k) + _nbytes(v) + _nbytes(out)
        if out.requires_grad and q.requires_grad:
            call = len(self.fwd_marks)
            box = self.bwd_marks.setdefault(call, [part, None, None])
            out.register_hook(lambda g, box=box: box.__setitem__(1, self.clock.mark()))
            q.register_hook(lambda g, box=box: box.__setitem__(2, self.clock.mark()))
        return out

    def times(self) -> tuple[dict[int, float], dict[int, float]]:
        """(forward, backward) seconds per part (after the pass, clock synchronised)."""
        fwd: dict[int, float] = defaultdict(float)
        bwd: dict[int, float] = defaultdict(float)
        for part, a, b in self.fwd_marks:
            fwd[part] += self.clock.elapsed(a, b)
        for part, a, b in self.bwd_marks.values():
            if a is not None and b is not None:
                bwd[part] += max(self.clock.elapsed(a, b), 0.0)
        return fwd, bwd


class KeptBytes(TorchDispatchMode):
    """Per part, the bytes of distinct storages the SELECTIVE mode's kept operators produce
    in forward."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self.bytes: dict[int, int] = defaultdict(int)
        # Storage addresses stay unique: the kept outputs are saved for backward, alive
        # through forward (holding references here would change the memory being measured).
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        phase, part = self.state()
        if phase == "fwd" and is_kept(func):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self._seen:
                    self._seen.add(t.untyped_storage().data_ptr())
                    self.bytes[part] += t.untyped_storage().nbytes()
        return out
