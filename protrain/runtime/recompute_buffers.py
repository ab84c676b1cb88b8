"""A recomputed block leaves the model's buffers as its forward left them.

A checkpointed block (CKPT, SELECTIVE) runs its forward twice, the second time in backward to
recompute what it did not keep. Modules that update a buffer in a training forward - BatchNorm's
running mean, variance and batch count - would update it twice, and the model would drift
from the one DeepSpeed trains (which runs each forward once). The recompute puts back every
buffer the block's forward changed as it was before the recompute: a normalisation layer's
running statistics (its kernel updates them without bumping the tensors' version counters),
and any other buffer whose version counter moved or that was replaced by another tensor. The
recomputed outputs are the same either way: in training BatchNorm normalises with the batch's
statistics.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase


def keep_buffers(block: nn.Module, context_fn=None):
    """``context_fn`` for torch.utils.checkpoint of ``block``: ``context_fn``'s own contexts
    (or none), and the recompute restoring what the forward changed in the block's buffers.
    None where the block has no buffers (then ``context_fn`` as given)."""
    slots = [(mod, name) for mod in block.modules() for name, b in mod._buffers.items() if b is not None]
    if not slots:
        return context_fn

    def contexts():
        fwd, rec = context_fn() if context_fn is not None else (contextlib.nullcontext(),) * 2
        watch = _Watch(slots)
        return _stack(fwd, watch.forward()), _stack(rec, watch.recompute())
    return contexts


class _Watch:
    """One checkpointed call: which buffers its forward changed, kept through its recompute."""

    def __init__(self, slots):
        self.slots = slots
        self.changed: list[tuple[nn.Module, str]] = []

    @contextlib.contextmanager
    def forward(self):
        before = [(mod._buffers.get(name), _version(mod._buffers.get(name))) for mod, name in self.slots]
        yield
        self.changed = [(mod, name) for (mod, name), (buf, v) in zip(self.slots, before)
                        if mod._buffers.get(name) is not buf or _version(buf) != v
                        or (isinstance(mod, _NormBase) and mod.training)]

    @contextlib.contextmanager
    def recompute(self):
        kept = [(mod, name, mod._buffers[name], mod._buffers[name].detach().clone())
                for mod, name in self.changed if mod._buffers.get(name) is not None]
        try:
            yield
        finally:
            with torch.no_grad():
                for mod, name, buf, value in kept:
                    mod._buffers[name] = buf
                    buf.copy_(value)


def _version(t) -> int | None:
    return None if t is None else t._version


@contextlib.contextmanager
def _stack(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield
