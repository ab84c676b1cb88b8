"""Module buffers: ProTrain's extra forwards leave them as a plain run leaves them.

A forward may change a module's buffers: BatchNorm's running statistics and
``num_batches_tracked``, a counter, a moving average. ProTrain runs forwards a plain run does
not (the profiled iterations, a checkpointed block's recompute in backward); each would
update those buffers once more, and the model would train and evaluate from other values.

- ``ModuleState``: the model's buffers and training flags before profiling, put back after it
  (and before each profiled iteration, so each starts from what the first training forward
  sees): the same tensor objects, their values copied back from host copies.
- ``buffers_context_fn(block)``: torch checkpoint's ``context_fn`` for a checkpointed block. Its
  forward context keeps a host copy of the block's buffers as the forward found them; its
  recompute context runs the recompute from those values, as the forward ran, and puts back
  what the forward left.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import nn


class ModuleState:
    """``model``'s buffers (which tensor each module holds under each name, and its values) and
    every module's training flag, as they are now."""

    def __init__(self, model: nn.Module):
        self.modules = list(model.modules())
        self.buffers = [dict(m._buffers) for m in self.modules]
        self.non_persistent = [set(m._non_persistent_buffers_set) for m in self.modules]
        self.training = [m.training for m in self.modules]
        self.values: dict[int, torch.Tensor] = {}
        for bufs in self.buffers:
            for b in bufs.values():
                if b is not None and id(b) not in self.values:
                    # On the host: a device copy would sit in the memory the profile measures.
                    self.values[id(b)] = b.detach().to("cpu", copy=True)

    @torch.no_grad()
    def restore_buffers(self) -> None:
        """Every module holds the buffers it held, with the values they had (a buffer
        registered since is dropped: the forward that made it will make it again)."""
        for m, bufs, names in zip(self.modules, self.buffers, self.non_persistent):
            m._buffers.clear()
            m._buffers.update(bufs)
            m._non_persistent_buffers_set.clear()
            m._non_persistent_buffers_set.update(names)
        done: set[int] = set()
        for bufs in self.buffers:
            for b in bufs.values():
                if b is not None and id(b) not in done:
                    b.copy_(self.values[id(b)])
                    done.add(id(b))

    def restore(self) -> None:
        """Buffers and training flags as they were."""
        self.restore_buffers()
        for m, training in zip(self.modules, self.training):
            m.training = training


class RecomputedBuffers:
    """One checkpointed call of a block: the forward and recompute contexts of its buffers.

    Every buffer is kept, changed or not: a tensor's version counter would tell which the
    forward changed, but BatchNorm's kernel updates its running statistics without bumping
    it, and comparing values would wait for the device. The copies are in host memory (on a
    GPU a non-blocking copy on the compute stream into pinned memory, read back on the same
    stream): the device holds nothing more between the forward and the recompute."""

    def __init__(self, block: nn.Module):
        self.slots = [(m, name) for m in block.modules() for name, b in m._buffers.items()
                      if b is not None]
        self.before: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
        """(module, name, the buffer the forward found, a host copy of its values then)."""

    @contextmanager
    def forward(self):
        with torch.no_grad():
            self.before = [(m, n, m._buffers[n], _to_host(m._buffers[n])) for m, n in self.slots]
        yield

    @contextmanager
    def recompute(self):
        left = []
        with torch.no_grad():
            for m, n, b, copy in self.before:
                left.append((m, n, m._buffers.get(n), b, b.detach().clone()))
                m._buffers[n] = b
                b.copy_(copy, non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for m, n, now, b, after in left:
                    b.copy_(after)
                    m._buffers[n] = now


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True, non_blocking=t.device.type == "cuda")


def buffers_context_fn(block: nn.Module):
    """torch.utils.checkpoint ``context_fn`` keeping ``block``'s buffers as a plain run leaves
    them (a pair of null contexts for a block without buffers)."""
    def context_fn():
        if not torch.is_grad_enabled():       # no backward, no recompute (an evaluation)
            return nullcontext(), nullcontext()
        state = RecomputedBuffers(block)
        if not state.slots:
            return nullcontext(), nullcontext()
        return state.forward(), state.recompute()
    return context_fn
