"""Per-block activation modes: NONE keeps, CKPT recomputes, SWAP moves to host memory.

- CKPT wraps the block's forward in torch's non-reentrant checkpoint (RNG state preserved),
  so only the block input is kept and the block is recomputed at the start of its backward.
- SWAP intercepts what autograd saves inside the block (saved-tensor hooks): each distinct
  storage is copied once (deduplicated: several saved views of one storage share one copy)
  into a pinned host arena on the offload queue, and the device copy is dropped once the copy
  is done - at most one swapped block in flight, as the cost model assumes. In backward the
  block's tensors are prefetched on the upload queue when the block after it starts its
  backward, and handed back to autograd from there.
- For every block, saved references to *parameters* (``weight.t()`` saved by a linear layer)
  are replaced by placeholders that re-materialise from wherever the parameter lives at
  backward time: an offloaded chunk may come back into a different buffer than the one it
  was in during forward.

A later mode (SSD, activations to NVMe) plugs in as another Stash next to ``HostStash``.
"""
from __future__ import annotations

import functools
import logging
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..block_mode import BlockMode
from ..profile.meter import storage_ptr
from .streams import Streams

log = logging.getLogger("protrain")


@dataclass(frozen=True, slots=True)
class ParamRef:
    """A saved view of a parameter, re-created from the parameter's current storage."""

    param: nn.Parameter
    delta: int
    size: torch.Size
    stride: tuple[int, ...]

    def materialize(self) -> torch.Tensor:
        base = self.param.data
        return base.as_strided(self.size, self.stride, base.storage_offset() + self.delta)


@dataclass(frozen=True, slots=True)
class SwapRef:
    """A saved tensor of a swapped block: which stored storage, and how to view it."""

    block: int
    key: int
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Stored:
    storage: object                           # weak reference: an address is only an identity
    nbytes: int
    host: torch.Tensor                        # uint8 slice of the block's arena
    device_src: torch.Tensor | None = None    # the device storage, held until the copy is done
    out_done: object = None
    device_back: torch.Tensor | None = None   # the prefetched device copy
    in_done: object = None
    packs: int = 0                            # saved tensors that view this storage
    unpacks: int = 0                          # ... handed back in this backward


@dataclass
class HostStash:
    """Pinned host arena of one swapped block, reused every iteration (bump allocation)."""

    arena: torch.Tensor
    used: int = 0
    stored: dict[int, _Stored] = field(default_factory=dict)
    overflowed: bool = False

    def alloc(self, nbytes: int, streams: Streams) -> torch.Tensor:
        start = (self.used + 511) // 512 * 512   # 512-byte alignment for fast copies
        if start + nbytes > self.arena.numel():
            if not self.overflowed:
                log.warning("protrain: a swapped block saved more than its profile said (%d bytes "
                            "beyond the arena); allocating extra pinned memory (slow). Re-plan if "
                            "shapes changed.", start + nbytes - self.arena.numel())
                self.overflowed = True
            return streams.pinned(nbytes, torch.uint8)
        self.used = start + nbytes
        return self.arena[start:start + nbytes]


class ActivationRuntime:
    def __init__(self, blocks: Sequence[nn.Module], modes: Sequence[BlockMode], streams: Streams,
                 device: torch.device, swap_bytes: Sequence[int], param_lookup):
        """``swap_bytes[i]``: bytes block i saved when profiled (sizes its arena);
        ``param_lookup(t)`` returns (param, delta) if ``t`` views a parameter in a chunk
        buffer, else None."""
        self.blocks = list(blocks)
        self.modes = list(modes)
        self.streams = streams
        self.device = device
        self.param_lookup = param_lookup
        self.current_block: int | None = None
        self.stashes: dict[int, HostStash] = {}
        for i, m in enumerate(self.modes):
            if m == BlockMode.SWAP:
                cap = int(swap_bytes[i] * 1.25) + 2**16
                self.stashes[i] = HostStash(streams.pinned(cap, torch.uint8))
        self._ckpt = checkpointed_blocks(self.blocks, self.modes)
        self._ckpt.__enter__()
        self.stats = {"swapped_bytes": 0, "swap_dedup_hits": 0, "prefetched_bytes": 0}

    def close(self) -> None:
        if self._ckpt is not None:
            self._ckpt.__exit__(None, None, None)
            self._ckpt = None

    # ---- saved-tensor hooks ----------------------------------------------------------------
    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.device != self.device:
            return t
        found = self.param_lookup(t)
        if found is True:
            return t                         # a view of a persistent chunk: it never moves
        if found is not None:
            p, delta = found
            return ParamRef(p, delta, t.size(), t.stride())
        b = self.current_block
        if b is None or b not in self.stashes:
            return t
        stash = self.stashes[b]
        st = t.untyped_storage()
        key = storage_ptr(t)
        entry = stash.stored.get(key)
        if entry is not None and entry.storage() is not st:
            # Same address, another storage (the first was freed). SSDTrain keyed by address
            # alone and could hand back the wrong tensor; identity is checked here. A fresh key
            # keeps both entries apart.
            key = -len(stash.stored) - 1
            entry = None
        if entry is None:
            src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(st)
            host = stash.alloc(src.numel(), self.streams)
            entry = _Stored(storage=weakref.ref(st), nbytes=src.numel(), host=host, device_src=src)
            entry.out_done = self.streams.copy(host, src, "offload", after=self.streams.compute_event())
            stash.stored[key] = entry
            self.stats["swapped_bytes"] += entry.nbytes
        else:
            self.stats["swap_dedup_hits"] += 1
        entry.packs += 1
        return SwapRef(b, key, t.dtype, t.size(), t.stride(), t.storage_offset())

    def unpack(self, obj):
        if isinstance(obj, ParamRef):
            return obj.materialize()
        if isinstance(obj, SwapRef):
            entry = self.stashes[obj.block].stored[obj.key]
            if entry.device_back is None:
                self._fetch(entry)
            self.streams.wait(entry.in_done)
            out = torch.empty(0, dtype=obj.dtype, device=self.device).set_(
                entry.device_back.untyped_storage(), obj.offset, obj.size, obj.stride)
            entry.unpacks += 1
            if entry.unpacks >= entry.packs:
                # Every saved view is with autograd now: let the storage go when autograd
                # is done with it, as it would free a kept tensor (not at the block's end).
                entry.device_back = None
            return out
        return obj

    # ---- schedule ----------------------------------------------------------------------------
    def enter_forward_block(self, i: int | None) -> None:
        """Forward moves into block ``i`` (None: out of the blocks). A swapped block's device
        copies are dropped once their copy is done, one block later."""
        self.current_block = i
        if i is not None:
            self._finish_swap_out(i - 2)
        else:
            for b in self.stashes:
                self._finish_swap_out(b)

    def _finish_swap_out(self, b: int) -> None:
        stash = self.stashes.get(b)
        if stash is None:
            return
        for entry in stash.stored.values():
            if entry.device_src is not None:
                self.streams.wait(entry.out_done)   # later kernels reuse that memory after the copy
                entry.device_src = None

    def prefetch(self, b: int) -> None:
        """Bring block ``b``'s swapped tensors back (upload queue)."""
        stash = self.stashes.get(b)
        if stash is None:
            return
        after = self.streams.compute_event()
        for entry in stash.stored.values():
            if entry.device_back is None and entry.unpacks == 0:
                self._fetch(entry, after)

    def _fetch(self, entry: _Stored, after=None) -> None:
        entry.device_back = torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)
        entry.in_done = self.streams.copy(entry.device_back, entry.host, "upload",
                                          after=[after or self.streams.compute_event(), entry.out_done])
        self.stats["prefetched_bytes"] += entry.nbytes

    def leave_backward_block(self, b: int) -> None:
        """Block ``b``'s backward is done: forget its stash for the next iteration."""
        stash = self.stashes.get(b)
        if stash is not None:
            stash.stored.clear()
            stash.used = 0

    def reset(self) -> None:
        for b in self.stashes:
            self.leave_backward_block(b)
        self.current_block = None


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


@contextmanager
def checkpointed_blocks(blocks: Sequence[nn.Module], modes: Sequence[BlockMode]):
    """Run the CKPT blocks of ``modes`` under checkpoint for the duration of the context (what
    the runtime does), e.g. to measure a plan's activation memory without the runtime."""
    saved = {}
    try:
        for i, (b, m) in enumerate(zip(blocks, modes)):
            if m == BlockMode.CKPT:
                saved[i] = b.forward
                b.forward = functools.partial(_checkpointed, b.forward)
        yield
    finally:
        for i, fwd in saved.items():
            blocks[i].forward = fwd
