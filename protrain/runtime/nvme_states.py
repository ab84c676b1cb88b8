"""Optimizer states of offloaded chunks on NVMe (issue 27): the state file, the staging ring,
and the order reads and write-backs run in.

The plan's last ``n_nvme`` chunks (``protrain.state_tier.nvme_chunk_ids``) keep their optimizer
states - exp_avg and exp_avg_sq, and the fp32 master where it is separate from the parameters
(16-bit training) - in one file per rank under ``ssd_path`` instead of host memory. Their
parameters and gradients stay in host memory. CPU Adam reaches the states through
``STAGING_SLOTS`` pinned staging buffers of one chunk's states each:

- the optimizer says, when it submits a task that needs a chunk's states to its host worker,
  which chunk it will need (``want``), so reads start in the order the worker runs its tasks:
  chunk k+1's states are read while chunk k is updated and chunk k-1 written back;
- the worker takes the chunk's states (``hold``: waits for its read; the chunk's ``master`` /
  ``exp_avg`` / ``exp_avg_sq`` become views of the staging buffer), updates them in place,
  and gives them back (``release``) with what happened: unchanged, updated, or updated
  speculatively; the staging buffer is free again once its write-back is done.

Two places on the drive per chunk make speculation exact without a copy of the states in host
memory: a chunk's *current* place holds its states as of the last step that stood. An update
writes the other place; an exact one makes it current at once, a speculative one (clipping or
fp16 loss scaling not decided yet) only when ``commit`` says so. A rollback (``discard``)
keeps the current place, so the redo re-reads the states from before the speculation, bit for
bit. In fp32 training the master is the parameters, in host memory, and a speculative update
changes it in place: the staging buffer then has a third field, the master as it was before
(``keep_master``), written with the speculative states, and read back into the parameters
after a rollback (``restore_master``). This trades the 12 bytes per parameter of host backup
a host-resident chunk keeps for twice the chunk's states (and that field) on the drive; a
redo costs one extra read of the chunk's states (the same bytes the first read moved) and in
fp32 of its master, paid only in steps that clip.

Order on the drive: a write waits for the previous write to its place (two writes in flight to
one place on a thread pool could land in either order); a read waits for the write that made
its place current. A chunk's next use starts its read only after its previous use was given
back (the place it reads is decided then). Nothing here touches device memory: the staging
buffers are host memory the CPU Adam kernel and the drive (O_DIRECT DMA, or kvikio's host
path) read and write; ``Streams.pinned`` page-locks them on CUDA machines, as the contract
counts them, and they are unpinned only after the store's threads have stopped.

The file lives in a ``RunDirectory`` (scratch: removed at exit, on SIGTERM / SIGHUP, and by the
next run after a kill -9). Checkpoints and re-plans read the states out through ``mapped``:
read-only views of the file's current places, so that exporting them needs no host memory of
their size (the kernel pages them in as ``torch.save`` or the new runtime reads them, and may
drop them again); a re-plan's views keep the old file's data alive after its directory is
removed, until the new runtime has written them into its own file. Imports write them back
chunk by chunk through ``loaded`` (``states.py``).
"""
from __future__ import annotations

import concurrent.futures as cf
import enum
import mmap
import os
import threading
import warnings
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Collection

import torch

from ..state_tier import (NVME_STATE_SLOTS, STAGING_SLOTS, field_stride,
                          staged_bytes_per_element, state_bytes_per_element, state_file_bytes)
from ..units import fmt_bytes
from .storage import (ALIGN, BlockFile, PosixStore, RunDirectory, StorageConfigError, StorageIOError,
                      check_region)
from .streams import Streams


class Outcome(enum.Enum):
    """What a holder did to the states it held (``NvmeStates.release``)."""

    UNCHANGED = "unchanged"
    """Read only: nothing is written back."""
    UPDATED = "updated"
    """Written to the chunk's other place, which becomes current."""
    SPECULATED = "speculated"
    """Written to the chunk's other place, current only once ``commit`` says the step stands."""


@dataclass(eq=False)
class _Staging:
    """One pinned staging buffer: one chunk's states at a time."""

    buf: torch.Tensor
    """4 KiB-aligned uint8 view of the pinned allocation (O_DIRECT wants aligned memory)."""
    free: bool = True


@dataclass(eq=False)
class _Use:
    """One wanted use of a chunk's states, in the order the worker will hold them."""

    chunk: int
    fields: int
    """Leading fields read (0: none; 1: the master only, for a shadow refresh; else the
    states)."""
    slot: _Staging | None = None
    read: cf.Future | None = None
    held: bool = False


@dataclass(eq=False)
class _Place:
    """Where one chunk's states are in the file."""

    shard_size: int
    offset: int
    """Byte offset of place 0; place 1 follows at ``offset + region``."""
    current: int = 0
    pending: int | None = None
    """The place a speculative update wrote, until ``commit`` or ``discard``."""
    written: list = field(default_factory=lambda: [None, None])
    """The last write to each place (a future of each field's CRC32 when verifying), which
    reads and later writes wait for, and every read of the place is checked against."""
    undo: int | None = None
    """fp32: the place whose master field holds the parameters from before the speculative
    update just discarded, until ``restore_master`` puts them back."""


class _AfterWrite:
    """A store's ``after`` (an object with ``synchronize()``) meaning: once this write is done."""

    def __init__(self, future: cf.Future):
        self.future = future

    def synchronize(self) -> None:
        self.future.result()


class NvmeStates:
    """The optimizer states of the chunks ``ids`` (``nvme_chunk_ids``) in a per-rank file under
    ``root``, streamed through a ring of ``slots`` pinned staging buffers."""

    def __init__(self, ids: Collection[int], root, streams: Streams, device: torch.device, *,
                 speculative: bool = False, verify: bool = False, slots: int = STAGING_SLOTS,
                 store=None):
        """``speculative``: updates may be speculative (clipping, fp16 loss scaling): in fp32
        the staging buffers and places hold the master from before them too."""
        if root is None:
            raise StorageConfigError(
                f"the plan keeps the optimizer states of {len(ids)} chunk(s) on NVMe (n_nvme) but "
                f"no ssd_path is configured; set protrain.ssd_path to a directory on an NVMe drive, "
                f"or pin n_nvme to 0")
        self.ids = frozenset(ids)
        self.root = root
        self.streams = streams
        self.device = device
        self.verify = verify
        self.n_slots = slots
        self.store = store
        self.rundir = self.file = None
        self.speculative = speculative
        self.fields = 0
        """Fields of a staging buffer and of a place on the drive."""
        self.state_fields = 0
        """Of them, the optimizer states (the master first in 16-bit training)."""
        self.master_backup = False
        """fp32 with speculation: a last field keeps the master from before a speculative update."""
        self.field_stride = 0
        """Bytes of one field (one fp32 tensor of the largest shard), 4 KiB-aligned."""
        self._places: dict[int, _Place] = {}
        self._ring: list[_Staging] = []
        self._raw: list[torch.Tensor] = []
        self._waiting: deque[_Use] = deque()
        self._active: list[_Use] = []
        self._cv = threading.Condition(threading.RLock())
        self._error: BaseException | None = None
        self.read_bytes = self.written_bytes = 0

    def __contains__(self, c) -> bool:
        return c.index in self.ids

    # ---- layout --------------------------------------------------------------------------
    def open(self, chunks, *, master_separate: bool) -> None:
        """Lay out the file for ``chunks`` (theirs shard sizes known), make the run directory,
        the store and the staging ring. ``master_separate``: the fp32 master is a state of its
        own (16-bit training) rather than the parameters (fp32)."""
        mine = [c for c in chunks if c.index in self.ids]
        # The planner prices the same layout (state_tier): fp32 fields of 4 bytes each.
        self.state_fields = state_bytes_per_element(master_separate) // 4
        self.fields = staged_bytes_per_element(master_separate, self.speculative) // 4
        self.master_backup = self.fields > self.state_fields
        largest = max((c.shard_size for c in mine), default=1)
        self.field_stride = field_stride(largest)
        region = self.fields * self.field_stride
        for i, c in enumerate(mine):
            self._places[c.index] = _Place(c.shard_size, i * NVME_STATE_SLOTS * region)
        # The size the planner priced (cost.memory.nvme_file_top): one function for both.
        at = state_file_bytes(len(mine), largest, self.fields)
        self.rundir = RunDirectory(self.root, at, purpose="the plan's optimizer states on NVMe (n_nvme)",
                                   knob="n_nvme")
        try:
            self.file = BlockFile(self.rundir.path / "states.opt", at)
            if self.store is None:
                self.store = host_state_store(self.verify, self.streams)
            for _ in range(self.n_slots):
                raw = self.streams.pinned(region + ALIGN, torch.uint8)
                skip = (-raw.data_ptr()) % ALIGN
                self._raw.append(raw)
                self._ring.append(_Staging(raw[skip:skip + region]))
        except BaseException:
            self.close()
            raise

    @property
    def backend(self) -> str:
        """The store and why it was chosen (``choose_store``), for the start-up report."""
        reason = getattr(self.store, "reason", None)
        return f"{self.store.name} ({reason})" if reason else self.store.name

    def state_bytes(self) -> int:
        """Bytes of optimizer state on the drive (one current copy of each chunk's)."""
        return sum(4 * self.state_fields * p.shard_size for p in self._places.values())

    def file_bytes(self) -> int:
        """Bytes the state file takes on the drive (two places per chunk, 4 KiB-aligned)."""
        return self.file.capacity if self.file is not None else 0

    def staging_bytes(self) -> int:
        """Host bytes of the staging ring (pinned)."""
        return sum(t.numel() for t in self._raw)

    def store_initial(self, c, master: torch.Tensor | None) -> None:
        """Write ``c``'s states as a fresh optimizer has them: moments zero, the master from
        ``master`` (any dtype; 16-bit training) - through a staging buffer, waited for."""
        u = self.want(c, fresh=True)
        slot = self._wait_slot(u)
        views = self._views(slot, self._places[c.index].shard_size, self.state_fields)
        for v in views:
            v.zero_()
        if master is not None:
            views[0].copy_(master)
        self._release(u, Outcome.UPDATED)
        self.drain()

    # ---- the ring --------------------------------------------------------------------------
    def want(self, c, *, master_only: bool = False, fresh: bool = False) -> _Use:
        """A task that will ``hold`` ``c``'s states was (or is about to be) queued on the host
        worker: start their read as soon as a staging buffer is free and the uses wanted
        before it have theirs. ``master_only``: the master field only (16-bit training);
        ``fresh``: nothing is read (the holder writes every state)."""
        u = _Use(c.index, 0 if fresh else 1 if master_only else self.state_fields)
        with self._cv:
            self._raise_if_failed()
            self._waiting.append(u)
            self._pump()
        return u

    def hold(self, c, u: _Use) -> None:
        """Worker: wait for ``u``'s read, then make ``c``'s state tensors views of its buffer."""
        slot = self._wait_slot(u)
        try:
            u.read.result()                       # a StorageIOError names the file and offset
        except BaseException:
            self._release(u, Outcome.UNCHANGED)
            raise
        u.held = True
        self._attach(c, slot, u.fields)

    def release(self, c, u: _Use, outcome: Outcome) -> None:
        """Give ``c``'s states back (held or not), writing them back per ``outcome``."""
        if u.held:
            self._detach(c)
        self._release(u, outcome)

    @contextmanager
    def loaded(self, c, *, write: bool = False, master_only: bool = False):
        """``c``'s states in host memory for the body (the chunk's tensors are views of a
        staging buffer), written back after it with ``write``. For checkpoints and re-plans,
        on the main thread with the host worker idle (its uses would come first)."""
        u = self.want(c, master_only=master_only)
        self.hold(c, u)
        outcome = Outcome.UNCHANGED
        try:
            yield
            outcome = Outcome.UPDATED if write else Outcome.UNCHANGED
        finally:
            self.release(c, u, outcome)
        if write:
            self.drain()

    @contextmanager
    def mapped(self):
        """``view(c, lo, hi)`` in the body: ``c``'s current states, elements [lo, hi) of its
        shard - (master, exp_avg, exp_avg_sq) in 16-bit training, (exp_avg, exp_avg_sq) in fp32
        - as read-only tensors over a shared mapping of the state file, each with a storage of
        its own (``torch.save`` writes a storage whole). For checkpoints and re-plans, with the
        host worker idle: every write is waited for, and no speculation may be pending (its
        place is not decided). The views keep the mapping, and the file's data, alive after
        ``close``; writing into them is a fault (PROT_READ)."""
        self.drain()
        with self._cv:
            open_ = [i for i, p in self._places.items() if p.pending is not None or p.undo is not None]
        if open_:
            raise RuntimeError(f"protrain: the states of chunks {open_} on NVMe are speculative "
                               f"(neither committed nor rolled back); export them after the step's verdict")
        size = os.fstat(self.file.fd).st_size
        if size < self.file.capacity:
            raise StorageIOError(
                f"{self.file.path}: the optimizer states' file is {size} bytes where {self.file.capacity} "
                f"were laid out and written - it was truncated (another process, or a cleanup of "
                f"{self.root}) and the states past its end are lost. Resume from the last checkpoint")
        # MAP_SHARED, read-only: no commit charge however large the file, pages reclaimable.
        whole = mmap.mmap(self.file.fd, self.file.capacity, access=mmap.ACCESS_READ)
        # What is exported (a checkpoint, a re-plan's new file) is certified by its own checksum
        # from here on: it must be what was written, checked before anyone copies it.
        self._check_current(whole)

        def view(c, lo: int, hi: int) -> list[torch.Tensor]:
            p = self._places[c.index]
            base = p.offset + p.current * self.fields * self.field_stride + 4 * lo
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                return [torch.frombuffer(whole, dtype=torch.float32, count=hi - lo,
                                         offset=base + k * self.field_stride)
                        for k in range(self.state_fields)]
        yield view

    def _check_current(self, whole: mmap.mmap) -> None:
        """Every chunk's current states in the mapping against their checksums at the write."""
        for p in self._places.values():
            last = p.written[p.current]
            crcs = last.result() if last is not None and not last.cancelled() else None
            if crcs is None:
                continue
            base = p.offset + p.current * self.fields * self.field_stride
            with memoryview(whole) as view:
                for start, length, k in self._checks(p, range(self.state_fields)):
                    check_region(self.file, base + start, view[base + start:base + start + length], crcs[k])

    def commit(self, c) -> None:
        """The step stands: ``c``'s speculative update (written, or being written) is current."""
        with self._cv:
            p = self._places[c.index]
            if p.pending is not None:
                p.current, p.pending = p.pending, None

    def discard(self, c) -> None:
        """The step does not stand as speculated: ``c``'s current place keeps the states from
        before the speculative update (a redo reads them there); in fp32 ``restore_master``
        must put the parameters back before anything reads them."""
        with self._cv:
            p = self._places[c.index]
            if self.master_backup and p.pending is not None:
                p.undo = p.pending
            p.pending = None

    def keep_master(self, c) -> None:
        """Holder, before a speculative update in fp32: keep ``c``'s master (the parameters,
        changed in place) in the held buffer's last field, written back with the states."""
        if self.master_backup:
            with self._cv:
                u = next(u for u in self._active if u.chunk == c.index and u.held)
            self._views(u.slot, c.shard_size, self.fields)[-1].copy_(c.master)

    def restore_master(self, c) -> None:
        """fp32, after ``discard``: read the parameters from before the discarded speculative
        update back into ``c.master`` (host memory nobody else uses until the chunk's redo is
        done), waiting for the speculative write first."""
        with self._cv:
            p = self._places[c.index]
            place, p.undo = p.undo, None
            if place is None:
                return
            last = p.written[place]
            offset = p.offset + (place * self.fields + self.fields - 1) * self.field_stride
        n = 4 * c.shard_size
        self.store.read(self.file, offset, c.master.view(torch.uint8)[:n], written=last,
                        checks=[(0, n, self.fields - 1)]).result()
        self.read_bytes += n

    def fail(self) -> None:
        """The host worker failed (its tasks are skipped): wake whoever waits for a buffer."""
        with self._cv:
            self._error = self._error or RuntimeError("protrain: host-side optimizer work failed")
            self._cv.notify_all()

    def drain(self) -> None:
        """Wait until every read and write-back is done (raising the first I/O error)."""
        with self._cv:
            while self._active or self._waiting or not all(s.free for s in self._ring):
                if self._error is not None:
                    break
                self._cv.wait()
            self._raise_if_failed()

    def close(self) -> None:
        """Stop the store (waiting for its I/O), close the file, remove the run directory, give
        the staging buffers back: in that order, as ActivationRuntime.close (an I/O still
        running uses the file descriptor, and the pinned buffers)."""
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.rundir is not None:
            self.rundir.close()
            self.rundir = None
        for t in self._raw:
            self.streams.unpin(t)
        self._raw, self._ring = [], []

    # ---- internals (the lock is an RLock: a future's done-callback may run inline) ---------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"protrain: optimizer states on NVMe: {self._error}") from self._error

    def _pump(self) -> None:
        """Start the reads of the uses waiting, in order, while buffers are free; a use of a
        chunk whose previous use is not given back yet waits (its place is not decided)."""
        while self._waiting:
            u = self._waiting[0]
            if any(a.chunk == u.chunk for a in self._active):
                return
            slot = next((s for s in self._ring if s.free), None)
            if slot is None:
                return
            self._waiting.popleft()
            slot.free = False
            u.slot = slot
            self._active.append(u)
            p = self._places[u.chunk]
            nbytes = u.fields * self.field_stride
            offset = p.offset + p.current * self.fields * self.field_stride
            last = p.written[p.current]
            if nbytes == 0:
                u.read = cf.Future()
                u.read.set_result(None)
                self._cv.notify_all()
                continue
            # Each field read is checked against its checksum taken at the write (a read of the
            # states after a speculative write of three fields, or of the master alone, too).
            try:
                u.read = self.store.read(self.file, offset, slot.buf[:nbytes], written=last,
                                         checks=self._checks(p, range(u.fields)))
            except BaseException as e:  # noqa: BLE001 - on a store thread (a write-back's callback): keep it for hold()
                u.read = cf.Future()
                u.read.set_exception(e)
                self._error = self._error or e
                self._cv.notify_all()
                continue
            self.read_bytes += nbytes
            self._cv.notify_all()

    def _wait_slot(self, u: _Use) -> _Staging:
        with self._cv:
            while u.slot is None:
                self._raise_if_failed()
                self._cv.wait()
            return u.slot

    def _release(self, u: _Use, outcome: Outcome) -> None:
        with self._cv:
            if u.slot is None:                    # never started: forget it
                self._waiting.remove(u)
                self._pump()
                return
        if not u.read.done():
            cf.wait([u.read])                     # the buffer is the read's until it lands
        with self._cv:
            self._active.remove(u)
            slot = u.slot
            if outcome is Outcome.UNCHANGED or u.read.exception() is not None:
                slot.free = True
                self._pump()
                self._cv.notify_all()
                return
            p = self._places[u.chunk]
            target = 1 - p.current
            prev = p.written[target]
            region = self.fields * self.field_stride
            # A speculative write keeps the master from before it too (fp32, keep_master).
            fields = self.fields if outcome is Outcome.SPECULATED else self.state_fields
            nbytes = fields * self.field_stride
            done = self.store.write(self.file, p.offset + target * region, slot.buf[:nbytes],
                                    after=_AfterWrite(prev) if prev is not None else None,
                                    regions=[(a, n) for a, n, _ in self._checks(p, range(fields))])
            self.written_bytes += nbytes
            p.written[target] = done
            if outcome is Outcome.UPDATED:
                p.current, p.pending = target, None
            else:
                p.pending = target
            self._pump()
        done.add_done_callback(lambda f, slot=slot: self._written(f, slot))

    def _written(self, f: cf.Future, slot: _Staging) -> None:
        """A write-back finished (a store thread, or inline): its buffer is free again."""
        with self._cv:
            if not f.cancelled() and f.exception() is not None and self._error is None:
                self._error = f.exception()
            slot.free = True
            self._pump()
            self._cv.notify_all()

    def _checks(self, p: _Place, fields) -> list[tuple[int, int, int]]:
        """(start, length, field) of each of ``fields`` of a place: the bytes of the chunk's
        shard in the field (the rest of the stride is padding nobody reads)."""
        return [(k * self.field_stride, 4 * p.shard_size, k) for k in fields]

    def _views(self, slot: _Staging, shard_size: int, fields: int) -> list[torch.Tensor]:
        flat = slot.buf[:fields * self.field_stride].view(torch.float32)
        return list(flat.view(fields, self.field_stride // 4)[:, :shard_size].unbind())

    def _attach(self, c, slot: _Staging, fields: int) -> None:
        views = self._views(slot, c.shard_size, fields)
        if self.state_fields == 3:
            c.master = views[0]
            if fields == 3:
                c.exp_avg, c.exp_avg_sq = views[1], views[2]
        else:
            c.exp_avg, c.exp_avg_sq = views

    def _detach(self, c) -> None:
        if self.state_fields == 3:
            c.master = None
        c.exp_avg = c.exp_avg_sq = None

    def describe(self) -> str:
        """Which chunks, how many bytes, what staging: the start-up line's middle."""
        ids = sorted(self.ids)
        which = f"chunks {ids[0]}..{ids[-1]}" if len(ids) > 1 else f"chunk {ids[0]}"
        return (f"{which}: {fmt_bytes(self.state_bytes())} of optimizer states, {self.n_slots} "
                f"staging buffers of {fmt_bytes(self.fields * self.field_stride)}"
                + (" (states and the master before a speculative update)" if self.master_backup else ""))


def host_state_store(verify: bool, streams) -> PosixStore:
    """The store of the states on NVMe: POSIX (O_DIRECT from the pinned staging ring), also
    where kvikio does GPUDirect Storage. The states move between the drive and host memory
    only (CPU Adam updates them there); GDS moves device memory, and kvikio's ``CuFile``
    takes device arrays or the buffer protocol, not a CPU ``torch.Tensor`` - the activation
    tier's choice (``choose_store``), handed these host buffers, failed at the first write."""
    store = PosixStore(verify=verify, streams=streams)
    store.reason = "host staging buffers: GPUDirect Storage moves device memory, these states live on the host"
    return store
