"""Per-block activation modes: NONE keeps, CKPT recomputes, SWAP moves to host memory.

- CKPT wraps the block's forward in torch's non-reentrant checkpoint (RNG state preserved),
  so only the block input is kept and the block is recomputed at the start of its backward.
- SELECTIVE does the same with a selective-checkpoint policy (protrain.runtime.selective):
  attention's and the all-to-alls' outputs are kept, everything else is recomputed.
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

- CKPT_HOST is CKPT with a HostStash, CKPT_SSD CKPT with an SSDStash: under the checkpoint the
  only tensors autograd saves through these hooks are the checkpoint's inputs (torch's
  checkpoint saves them before it pushes its own hooks), so the block's input is what goes to
  host memory (or the drive) and comes back one block ahead of the recompute. An input passed
  as a keyword stays on the device (torch's checkpoint holds keyword arguments itself): said
  once.

- SSD writes the same storages to a per-block file on NVMe (SSDTrain) through the storage
  backend (kvikio GPUDirect Storage, its compatibility mode, or POSIX); storages under
  ``ssd_min_bytes`` stay on the device. Forwarding: a tensor still in device memory when its
  block's backward needs it is handed back as is, and its write skipped if not yet started.
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..block_mode import BlockMode, activation_file_bytes
from .boundaries import block_positions, version
from .meter import storage_ptr
from .buffers import buffers_context_fn
from .forward_patches import ForwardPatches
from .selective import combine_context_fns, selective_context_fn
from .storage import BlockFile, RunDirectory, StorageConfigError, choose_store
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
    device_src: torch.Tensor | None = None    # the device storage, held until the write is done
    out_done: object = None                   # event (host) or future (NVMe) of the write
    device_back: torch.Tensor | None = None   # the prefetched device copy
    in_done: object = None                    # event or future of the read
    packs: int = 0                            # saved tensors that view this storage
    unpacks: int = 0                          # ... handed back in this backward
    host: torch.Tensor | None = None          # HostStash: the slice of the arena
    offset: int = 0                           # SSDStash: where in the block's file


@dataclass
class HostStash:
    """SWAP: pinned host arena of one block, reused every iteration (bump allocation); copies
    on the offload / upload streams. A block that saves more than its arena holds (a shape
    the profile did not see) gets extra pinned regions for that iteration; at the end of the
    iteration they are given back and the arena grows to what the block needed, so the next
    iterations allocate nothing."""

    arena: torch.Tensor
    streams: Streams
    used: int = 0
    stored: dict[int, _Stored] = field(default_factory=dict)
    extra: list[torch.Tensor] = field(default_factory=list)
    """Pinned regions beyond the arena, this iteration."""
    need: int = 0
    """Arena bytes this iteration would have needed."""
    min_bytes: int = 0

    def _alloc(self, nbytes: int) -> torch.Tensor:
        start = (self.used + 511) // 512 * 512   # 512-byte alignment for fast copies
        self.used = start + nbytes
        self.need = max(self.need, self.used)
        if self.used > self.arena.numel():
            if not self.extra:
                log.warning("protrain: a swapped block saved more than its profile said (%d bytes "
                            "beyond the arena); extra pinned memory this iteration, a larger arena "
                            "from the next. Re-plan if shapes changed for good.",
                            self.used - self.arena.numel())
            self.extra.append(self.streams.pinned(nbytes, torch.uint8, "a swapped block's activations "
                                                  "beyond its arena"))
            return self.extra[-1]
        return self.arena[start:start + nbytes]

    def begin_write(self, e: _Stored, src: torch.Tensor) -> None:
        e.host = self._alloc(src.numel())
        e.out_done = self.streams.copy(e.host, src, "offload", after=self.streams.compute_event())

    def finish_write(self, e: _Stored) -> None:
        self.streams.wait(e.out_done)     # later kernels reuse that memory after the copy

    def begin_read(self, e: _Stored, dst: torch.Tensor, after) -> None:
        e.in_done = self.streams.copy(dst, e.host, "upload", after=[after, e.out_done])

    def finish_read(self, e: _Stored) -> None:
        self.streams.wait(e.in_done)

    def cancel_write(self, e: _Stored) -> bool:
        return False

    def reset(self) -> None:
        for e in self.stored.values():
            if e.device_src is not None:
                # Written in a forward that did not finish (an error): the copy still reads
                # device memory the allocator reuses once the entry is dropped.
                self.finish_write(e)
            if e.device_back is not None:
                # Prefetched but never handed back: the upload queue may still be writing
                # there, and the caching allocator would give that memory to the compute
                # stream as soon as it is dropped.
                self.streams.wait(e.in_done)
        if self.extra:
            # The arena and the extra regions are unregistered and dropped below: pinned pages
            # the swap-outs wrote and the prefetches read. The waits above and in backward only
            # hold the compute stream; the host must know every such copy is over before the
            # pages are given back (else a queued copy reads or writes memory that is no longer
            # pinned, or no longer ours). Only when an arena grows: a shape change.
            for e in self.stored.values():
                self.streams.host_wait(e.out_done)
                self.streams.host_wait(e.in_done)
        self.stored.clear()
        self.used = 0
        if self.extra:
            for t in self.extra:
                self.streams.unpin(t)
            self.extra = []
            self.streams.unpin(self.arena)
            self.arena = self.streams.pinned(self.need, torch.uint8, "a swapped block's larger arena")
        self.need = 0

    def close(self) -> None:
        """Give the pinned memory back (the copies are done)."""
        for t in self.extra + [self.arena]:
            self.streams.unpin(t)
        self.extra = []


@dataclass
class SSDStash:
    """SSD (SSDTrain): one preallocated file per block on the NVMe path; writes and reads are
    futures of the storage backend (kvikio GDS / compat, or POSIX)."""

    file: BlockFile
    store: object
    streams: Streams
    min_bytes: int = 0
    """Smaller storages stay on the device (the I/O would cost more than the memory)."""
    stored: dict[int, _Stored] = field(default_factory=dict)

    def begin_write(self, e: _Stored, src: torch.Tensor) -> None:
        e.offset = self.file.alloc(src.numel())
        e.out_done = self.store.write(self.file, e.offset, src, after=self.streams.compute_event())

    def finish_write(self, e: _Stored) -> None:
        if not e.out_done.cancelled():
            e.out_done.result()               # raises StorageIOError naming file and offset

    def begin_read(self, e: _Stored, dst: torch.Tensor, after) -> None:
        # On the load pool: after the write (checksum checked in verify mode) and after the
        # compute stream reached this point (dst may reuse memory it just freed).
        e.in_done = self.store.read(self.file, e.offset, dst, e.out_done, after)

    def finish_read(self, e: _Stored) -> None:
        if e.in_done is not None:
            e.in_done.result()                # raises StorageIOError naming file and offset

    def cancel_write(self, e: _Stored) -> bool:
        return e.out_done is not None and e.out_done.cancel()

    def reset(self) -> None:
        # As HostStash.reset: after an error (mid-forward, mid-backward) reads into prefetched
        # device buffers never handed back, and writes from device storages, may still run.
        # Their buffers must outlive them (today the backends' pool calls hold them until they
        # return: not a contract), and the file's offsets start over at 0: a late write would
        # land on the next iteration's data. Waited for without raising: nothing needs their
        # results any more. After a finished backward they are all done (each read was waited
        # for in unpack, and waited for its write).
        cf.wait([f for e in self.stored.values() for f in (e.out_done, e.in_done) if f is not None])
        self.stored.clear()
        self.file.reset()


class ActivationRuntime:
    def __init__(self, blocks: Sequence[nn.Module], modes: Sequence[BlockMode], streams: Streams,
                 device: torch.device, swap_bytes: Sequence[int], param_lookup, *,
                 ssd_root=None, ssd_verify: bool = False, ssd_min_bytes: int = 2**20, ssd_store=None,
                 checkpoint_context_fn=None, input_bytes: Sequence[int] = ()):
        """``swap_bytes[i]``: bytes block i saved when profiled (sizes its arena or file);
        ``input_bytes[i]``: its input's bytes (sizes a CKPT_HOST block's arena);
        ``param_lookup(t)`` returns (param, delta) if ``t`` views a parameter in a chunk
        buffer, True for a persistent chunk, else None. SSD blocks need ``ssd_root``: a per-run
        directory is made under it and removed by ``close`` / at exit / on SIGTERM."""
        self.blocks = list(blocks)
        self.modes = list(modes)
        self.streams = streams
        self.device = device
        self.param_lookup = param_lookup
        self.current_block: int | None = None
        self.stashes: dict[int, HostStash | SSDStash] = {}
        self.rundir = self.store = None
        moved = (BlockMode.CKPT_HOST, BlockMode.CKPT_SSD)       # checkpointed, the input moved
        caps = {i: activation_file_bytes(input_bytes[i] if m in moved and i < len(input_bytes) else swap_bytes[i])
                for i, m in enumerate(self.modes)}
        # The pinned arenas first: one the host cannot give fails before the SSD run directory
        # (its preallocated files) and its store's threads exist, which nothing would close.
        for i, m in enumerate(self.modes):
            if m in (BlockMode.SWAP, BlockMode.CKPT_HOST):
                what = "swapped activations" if m == BlockMode.SWAP else "checkpointed input"
                self.stashes[i] = HostStash(streams.pinned(caps[i], torch.uint8, f"block {i}'s {what}"),
                                            streams)
        ssd_blocks = [i for i, m in enumerate(self.modes) if m in (BlockMode.SSD, BlockMode.CKPT_SSD)]
        if ssd_blocks:
            if ssd_root is None:
                raise StorageConfigError("the plan puts blocks on NVMe but no ssd_path is configured")
            self.rundir = RunDirectory(ssd_root, sum(caps[i] for i in ssd_blocks))
            self.store = ssd_store or choose_store(device, self.rundir.path, verify=ssd_verify,
                                                   streams=streams)
            for i in ssd_blocks:
                self.stashes[i] = SSDStash(BlockFile(self.rundir.path / f"block{i:04d}.act", caps[i]),
                                           self.store, streams, min_bytes=ssd_min_bytes)
        self._checkpoint_context_fn = checkpoint_context_fn
        self._warned_input = False
        self._inputs_seen: set[int] = set()      # CKPT_HOST / CKPT_SSD blocks that packed this forward
        self._ckpt = None
        self.wrap_blocks()
        self.stats = {"swapped_bytes": 0, "swap_dedup_hits": 0, "prefetched_bytes": 0,
                      "ssd_written_bytes": 0, "ssd_read_bytes": 0, "forwarded": 0,
                      "writes_skipped": 0, "kept_small": 0}

    @property
    def storage_backend(self) -> str | None:
        return self.store.name if self.store is not None else None

    @property
    def storage_choice(self) -> str | None:
        """The NVMe backend and why it was chosen (``choose_store``), for the start-up report."""
        reason = getattr(self.store, "reason", None)
        return f"{self.store.name} ({reason})" if reason else self.storage_backend

    def wrap_blocks(self) -> None:
        """Put the CKPT and SELECTIVE blocks' forwards under checkpoint."""
        if self._ckpt is None:
            self._ckpt = checkpointed_blocks(self.blocks, self.modes, self._checkpoint_context_fn,
                                             position=lambda: self.current_block)
            self._ckpt.__enter__()

    def unwrap_blocks(self) -> None:
        if self._ckpt is not None:
            self._ckpt.__exit__(None, None, None)
            self._ckpt = None

    def close(self) -> None:
        self.unwrap_blocks()
        self.streams.synchronize()       # no queued copy may still use what is given back
        if self.store is not None:
            # Drained before the files close: a write or read still running uses their file
            # descriptors (closed, one would fail; reused by the next open, it would write into
            # another file - the new plan's, after an out-of-memory re-plan).
            self.store.close()
            self.store = None
        for stash in self.stashes.values():
            if isinstance(stash, SSDStash):
                stash.file.close()
            else:
                stash.close()
        if self.rundir is not None:
            self.rundir.close()
            self.rundir = None

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
        self._inputs_seen.add(b)
        st = t.untyped_storage()
        if st.nbytes() < stash.min_bytes:
            self.stats["kept_small"] += 1
            return t
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
            entry = _Stored(storage=weakref.ref(st), nbytes=src.numel(), device_src=src)
            stash.begin_write(entry, src)
            stash.stored[key] = entry
            self.stats["ssd_written_bytes" if isinstance(stash, SSDStash) else "swapped_bytes"] += entry.nbytes
        else:
            self.stats["swap_dedup_hits"] += 1
        entry.packs += 1
        return SwapRef(b, key, t.dtype, t.size(), t.stride(), t.storage_offset())

    def unpack(self, obj):
        if isinstance(obj, ParamRef):
            return obj.materialize()
        if isinstance(obj, SwapRef):
            stash = self.stashes[obj.block]
            entry = stash.stored.get(obj.key)
            if entry is None:
                raise RuntimeError(
                    f"ProTrain: block {obj.block}'s backward needs an activation it saved in "
                    f"forward ({obj.dtype}, {tuple(obj.size)}), and its {self.modes[obj.block].name} "
                    f"stash was already let go: the backward left the block before this use "
                    f"(the block's output reached backward by a path the part boundaries do not "
                    f"see, e.g. a block called twice on inputs that do not chain). Pin n_swap=0 and "
                    f"n_ssd=0, or call each block once per forward")
            if entry.device_back is None:
                self._fetch(stash, entry)
            stash.finish_read(entry)
            out = torch.empty(0, dtype=obj.dtype, device=self.device).set_(
                entry.device_back.untyped_storage(), obj.offset, obj.size, obj.stride)
            entry.unpacks += 1
            if entry.unpacks >= entry.packs:
                # Every saved view is with autograd now: let the storage go when autograd
                # is done with it, as it would free a kept tensor (not at the block's end).
                entry.device_back = None
            return out
        return obj

    # ---- schedule (parts as in ModelProfile: 0 pre, i + 1 block i, last post) -----------------
    def forward_part(self, part: int) -> None:
        """Forward enters ``part``; the post part counts as block N for the swap throttle."""
        self.enter_forward_block(part - 1 if part >= 1 else None)

    def backward_start(self) -> None:
        """Backward is about to start: bring the last block's offloaded tensors back while the
        head's backward runs."""
        last = len(self.blocks) - 1
        if last >= 0 and self.modes[last] in (BlockMode.SWAP, BlockMode.SSD, BlockMode.CKPT_HOST,
                                              BlockMode.CKPT_SSD):
            self.prefetch(last)

    def backward_done_with(self, part: int) -> None:
        """Backward enters ``part``, so part + 1 is done: forget its stash."""
        if 1 <= part + 1 <= len(self.blocks):
            self.leave_backward_block(part)

    def backward_prefetch(self, part: int) -> None:
        """Backward enters ``part``: prefetch the block of ``part - 1`` (one block ahead)."""
        if part >= 2:
            self.prefetch(part - 2)

    def enter_forward_block(self, i: int | None) -> None:
        """Forward moves into block ``i`` (None: out of the blocks). An offloaded block's device
        copies are dropped once their write is done, one block later."""
        left = self.current_block
        if left is not None and left != i and left < len(self.modes) and \
                self.modes[left] in (BlockMode.CKPT_HOST, BlockMode.CKPT_SSD):
            self._check_input_moved(left)
        self.current_block = i
        if i is not None:
            self._finish_swap_out(i - 2)
        else:
            for b in self.stashes:
                self._finish_swap_out(b)

    def _check_input_moved(self, b: int) -> None:
        """A CKPT_HOST / CKPT_SSD block that ran under autograd and packed nothing got its input
        as a keyword argument (torch's checkpoint keeps those itself): the input stays on the
        device, more than the plan counted. Said once; the training is unchanged."""
        if b in self._inputs_seen or not torch.is_grad_enabled() or self._warned_input:
            self._inputs_seen.discard(b)
            return
        self._warned_input = True
        log.warning("protrain: block %d is checkpointed with its input in host memory, but its input "
                    "did not come as a positional tensor argument (torch's checkpoint keeps keyword "
                    "arguments on the device): it stays on the device, beyond the plan's memory "
                    "figures. Pin \"ckpt_input\": \"device\" to plan for that.", b)

    def _finish_swap_out(self, b: int) -> None:
        stash = self.stashes.get(b)
        if stash is None:
            return
        for entry in stash.stored.values():
            if entry.device_src is not None:
                stash.finish_write(entry)
                entry.device_src = None

    def prefetch(self, b: int) -> None:
        """Bring block ``b``'s offloaded tensors back (upload queue / NVMe reads)."""
        stash = self.stashes.get(b)
        if stash is None:
            return
        for entry in stash.stored.values():
            if entry.device_back is None and entry.unpacks == 0:
                self._fetch(stash, entry)

    def _fetch(self, stash, entry: _Stored) -> None:
        alive = entry.storage()
        if alive is not None:
            # Forwarding: the tensor is still in device memory (still in flight, or kept by
            # someone else): hand it back as is, and skip its write if it has not started.
            entry.device_back = torch.empty(0, dtype=torch.uint8, device=self.device).set_(alive)
            entry.in_done = None
            self.stats["forwarded"] += 1
            if stash.cancel_write(entry):
                self.stats["writes_skipped"] += 1
            return
        entry.device_back = torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)
        # The compute queue marked after the allocation: the buffer comes from the compute
        # stream's pool, and the read into it waits for every kernel queued before it got the
        # memory (a mark taken before the allocation is as good while no kernel is queued in
        # between, but the CUDA sanitizer cannot know that: it flagged it on the first GPU run).
        stash.begin_read(entry, entry.device_back, self.streams.compute_event())
        key = "ssd_read_bytes" if isinstance(stash, SSDStash) else "prefetched_bytes"
        self.stats[key] += entry.nbytes

    def leave_backward_block(self, b: int) -> None:
        """Block ``b``'s backward is done: forget its stash for the next iteration."""
        stash = self.stashes.get(b)
        if stash is not None:
            stash.reset()

    def reset(self) -> None:
        for b in self.stashes:
            self.leave_backward_block(b)
        self.current_block = None


def _checkpointed(forward, *args, _context_fn=None, **kwargs):
    extra = {"context_fn": _context_fn} if _context_fn is not None else {}
    given = [(t, version(t)) for t in args if isinstance(t, torch.Tensor)] + \
        [(t, version(t)) for t in kwargs.values() if isinstance(t, torch.Tensor)]
    out = checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)
    if torch.is_grad_enabled() and any(version(t) != v for t, v in given):
        # The recompute in backward would run from the changed input: refused, not trained
        # wrong (the planner checkpoints no block of a model it saw do this).
        raise RuntimeError(
            f"ProTrain: {getattr(forward, '__self__', forward).__class__.__name__} changed an "
            f"input in place in forward (x.add_(...) on what it was given) while it is "
            f"checkpointed: its recompute would run from the changed input. Pin "
            f"protrain.n_checkpoint and n_selective to 0 (a plan from plan_file or the profile "
            f"cache made before the model did this: delete them to plan again)")
    return out


def _by_position(forward, calls: dict, position, *args, **kwargs):
    """A module listed at positions of different modes: the mode of the position running now
    (none known: outside the runtime's forward, eager)."""
    fn = calls.get(position(), _EAGER)
    if fn is _EAGER:
        return forward(*args, **kwargs)
    return _checkpointed(forward, *args, _context_fn=fn, **kwargs)


_EAGER = object()


@contextmanager
def checkpointed_blocks(blocks: Sequence[nn.Module], modes: Sequence[BlockMode], context_fn=None,
                        position=None):
    """Run the CKPT, CKPT_HOST, CKPT_SSD and SELECTIVE blocks of ``modes`` under checkpoint for the duration of the
    context (what the runtime does), e.g. to measure a plan's activation memory without the
    runtime. ``context_fn`` is torch checkpoint's hook to restore framework RNG state on
    recompute (Megatron's tensor-parallel RNG tracker). The recompute leaves the block's
    buffers as the forward left them, and runs from the values the forward found
    (protrain.runtime.buffers): BatchNorm's statistics are updated once per forward, as in a
    plain run. A module listed at several positions (shared weights) is wrapped once; where
    their modes differ, ``position()`` - the index of the block running now, from the part
    boundaries - picks each call's."""
    with ForwardPatches() as patches:
        for ps in block_positions(blocks).values():
            b = blocks[ps[0]]
            calls = {}
            for i in ps:
                if modes[i] in (BlockMode.CKPT, BlockMode.CKPT_HOST, BlockMode.CKPT_SSD, BlockMode.SELECTIVE):
                    # The buffers' contexts outermost: their copies are not replayed by the
                    # selective policy, and the RNG restore runs from the forward's buffers too.
                    fn = combine_context_fns(buffers_context_fn(b), context_fn)
                    calls[i] = selective_context_fn(fn) if modes[i] == BlockMode.SELECTIVE else fn
            if not calls:
                continue
            if len({modes[i] for i in ps}) == 1:
                patches.replace(b, functools.partial(_checkpointed, b.forward, _context_fn=calls[ps[0]]))
            elif position is None:
                raise ValueError(f"block {ps[0]} is listed at positions {ps} with modes "
                                 f"{[modes[i].name for i in ps]}: pass position= (the block running)")
            else:
                patches.replace(b, functools.partial(_by_position, b.forward, calls, position))
        yield
