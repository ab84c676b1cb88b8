"""Chunks of model states and the device buffers they stream through.

The layout (which parameter sits where) comes from the Plan; this module allocates it:

- a *persistent* chunk lives on the device: parameters (training dtype), fp32 gradients, fp32
  master (16-bit training), Adam m and v; its parameters' ``.data`` are views into it;
- an *offloaded* chunk lives in host memory: fp32 master, m, v and, in 16-bit training, a
  copy of the parameters in the training dtype that is uploaded into one of ``n_buffer``
  device buffers ahead of use. While not resident its parameters' ``.data`` are views of that
  host copy (shapes stay right, values are the current weights); while resident, views of the
  buffer. After the chunk's backward its buffer holds its gradients (written in place: the
  parameters are not needed any more, the master is on the host) and is copied back.

Chunk states and their legal transitions (checked on every move):

    HOST -> UPLOADING -> RESIDENT -> CACHED -> RESIDENT (reused without a copy)
                                  \\-> GRADS -> HOST  (gradients offloaded)
    CACHED -> HOST (its buffer was taken by another chunk)

A *sharded persistent* chunk is an offloaded chunk whose home is the device: rank r keeps its
1/world shard of the parameters, gradients and optimizer states in device memory, gathers the
chunk into a buffer ahead of use (a device copy and an all-gather), reduce-scatters its
gradients into the shard after backward and updates the shard with device Adam at the step.
It moves through the same states as an offloaded chunk; with ``world`` ranks it holds 1/world
of a persistent chunk's device bytes (ZeRO-3 on the device), so several ranks keep more of the
model on their devices than one.

With several data-parallel ranks an offloaded chunk's host states are sharded: rank r keeps
its 1/world shard, an upload is the shard's copy followed by an all-gather, a gradient
offload is a reduce-scatter followed by the shard's copy (collectives.py). While not resident
the parameters of a sharded chunk have no values on this rank: their ``.data`` is empty.

No tensor is allocated in the steady-state loop: every buffer and host region is allocated
once, here.
"""
from __future__ import annotations

import enum
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from .collectives import DataParallel
from .streams import Streams

if TYPE_CHECKING:
    from .nvme_states import NvmeStates


class ChunkState(enum.Enum):
    HOST = "host"
    UPLOADING = "uploading"
    RESIDENT = "resident"
    CACHED = "cached"
    GRADS = "grads"


_LEGAL = {
    ChunkState.HOST: {ChunkState.UPLOADING},
    ChunkState.UPLOADING: {ChunkState.RESIDENT},
    ChunkState.RESIDENT: {ChunkState.CACHED, ChunkState.GRADS},
    ChunkState.CACHED: {ChunkState.RESIDENT, ChunkState.HOST},
    ChunkState.GRADS: {ChunkState.HOST},
}


@dataclass(eq=False)
class Slot:
    """One parameter's place in its chunk."""

    param: nn.Parameter
    name: str
    offset: int
    numel: int
    group: int
    """Index of the optimizer param group the parameter belongs to."""
    shape: torch.Size = torch.Size()
    """The parameter's shape (its ``.data`` may be an empty placeholder while sharded)."""
    has_grad: bool = False
    """A gradient arrived for it in this optimizer step. Adam steps it either way (on a zero
    gradient without one, as DeepSpeed ZeRO-0 does: ChunkOptimizer._update); without one its
    place in a device buffer still holds its values and is zeroed before the buffer's
    gradients are offloaded."""
    step: int = 0
    """Adam steps taken (kept per parameter for checkpoints; all parameters step together)."""

    @property
    def stop(self) -> int:
        return self.offset + self.numel


@dataclass(eq=False)
class Chunk:
    index: int
    numel: int
    persistent: bool
    slots: list[Slot]
    first_part: int
    last_part: int
    sharded: bool = False
    """A sharded persistent chunk (module docstring): its shard's states (``shadow``,
    ``grad_acc``, ``master``, ``exp_avg``, ``exp_avg_sq``) live on the device, device Adam
    updates them at the step. ``persistent`` is False for it: it streams through buffers."""
    updated: object = None
    """Sharded chunks: event after which the compute queue's last write of its device states
    (device Adam, a checkpoint's load, a skipped step's restore) is done; its upload waits."""
    # Device states (persistent chunks).
    data: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    # Host states (offloaded chunks).
    shadow: torch.Tensor | None = None
    """Parameters in the training dtype: the upload source (and, without gradient
    accumulation in 16-bit training, the landing region of the gradients)."""
    grad_acc: torch.Tensor | None = None
    """fp32 gradient landing / accumulation region (fp32 training or accumulation)."""
    # Optimizer states (device for persistent chunks, host for offloaded ones).
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    # Residency.
    state: ChunkState = ChunkState.HOST
    buffer: int | None = None
    ready: object = None
    """Event after which the chunk's data is in its buffer."""
    grads_on_host: object = None
    """Event after which the chunk's gradients are on the host."""
    grads_pending: bool = False
    """Gradients of this micro-step still to be folded into the host states."""
    shard_lo: int = 0
    """This rank's part of the chunk (offloaded chunks): elements [shard_lo, shard_hi)."""
    shard_hi: int = 0
    shard_size: int = 0
    """Elements of one shard (the host tensors' length; the buffer holds world of them)."""

    def move(self, new: ChunkState) -> None:
        if new not in _LEGAL[self.state]:
            raise RuntimeError(f"chunk {self.index}: illegal move {self.state.value} -> {new.value}")
        self.state = new


class BufferPool:
    """n_buffer device chunk buffers. A free buffer keeps its last chunk's data (CACHED) until
    taken; buffers are taken in the order they were freed, which is the FIFO reuse the cost
    model assumes (chunk c reuses the buffer of chunk c - n_buffer)."""

    def __init__(self, n: int, capacity: int, dtype: torch.dtype, device: torch.device):
        self.tensors = [torch.empty(capacity, dtype=dtype, device=device) for _ in range(n)]
        self.owner: list[Chunk | None] = [None] * n
        self.free_after: list[object] = [None] * n
        self.free = deque(range(n))

    def __len__(self) -> int:
        return len(self.tensors)

    def release(self, b: int, after_event) -> None:
        self.free_after[b] = after_event
        if b not in self.free:
            self.free.append(b)

    def take(self, b: int) -> None:
        self.free.remove(b)


class ChunkManager:
    """Allocates the chunks, moves them between host and device buffers, and keeps every
    parameter's ``.data`` pointing at where its values are."""

    def __init__(self, *, named_params: list[tuple[str, nn.Parameter]], param_chunk: list[int],
                 chunk_parts: list[tuple[int, int]], n_persist: int, n_buffer: int,
                 chunk_capacity: int, group_of: dict[nn.Parameter, int], device: torch.device,
                 streams: Streams, grad_accumulation: bool, dp: DataParallel | None = None,
                 nvme: "NvmeStates | None" = None, n_shard: int = 0):
        """``nvme``: where the optimizer states of the chunks it names live instead of host
        memory (nvme_states.py; opened here, once the shards are known). ``n_shard``: of the
        ``n_persist`` chunks on the device, how many (the last ones) are sharded persistent."""
        if not named_params:
            raise ValueError("no parameters to place in chunks")
        self.device = device
        self.streams = streams
        self.dp = dp or DataParallel(None)
        # Set by the optimizer: wait for a chunk's pending CPU Adam update / for all of them.
        self.host_ready: Callable[[Chunk], None] = lambda c: None
        """Block until the chunk's host copy is final (its CPU Adam update done)."""
        self.host_ready_now: Callable[[Chunk], bool] = lambda c: True
        """Whether it is final now, without waiting (prefetch asks this)."""
        self.host_sync: Callable[[], None] = lambda: None
        self.tracer = None               # runtime/timeline_recorder.py's, when a trace is on
        self.dtype = named_params[0][1].dtype
        self.half = self.dtype in (torch.float16, torch.bfloat16)
        self.n_persist = n_persist
        n_chunks = max(param_chunk) + 1
        if not 0 <= n_shard <= min(n_persist, n_chunks):
            raise ValueError(f"n_shard={n_shard}: sharded persistent chunks are some of the "
                             f"{min(n_persist, n_chunks)} persistent ones; use 0 to {min(n_persist, n_chunks)}")
        replicated = n_persist - n_shard
        slots: list[list[Slot]] = [[] for _ in range(n_chunks)]
        for (name, p), c in zip(named_params, param_chunk):
            if p.dtype != self.dtype:
                raise TypeError(f"parameter {name} is {p.dtype}, others are {self.dtype}: ProTrain "
                                f"chunks hold one training dtype (cast the model, or keep the odd "
                                f"parameter frozen with requires_grad=False)")
            off = slots[c][-1].stop if slots[c] else 0
            slots[c].append(Slot(p, name, off, p.numel(), group_of[p], shape=p.shape))
        self.chunks = [Chunk(i, s[-1].stop, i < replicated, s, *chunk_parts[i],
                             sharded=replicated <= i < n_persist)
                       for i, s in enumerate(slots)]
        self.slot_of: dict[nn.Parameter, tuple[Chunk, Slot]] = {
            s.param: (c, s) for c in self.chunks for s in c.slots}
        world = self.dp.world
        self.pool = BufferPool(n_buffer if replicated < n_chunks else 0,
                               -(-chunk_capacity // world) * world, self.dtype, device)
        self._empty = torch.empty(0, dtype=self.dtype)
        self.nvme = nvme
        self._materialize(grad_accumulation)

    # ---- allocation ----------------------------------------------------------------------
    def _materialize(self, grad_accumulation: bool) -> None:
        """Copy every parameter's current value into its chunk and repoint ``.data``. The
        optimizer states of chunks on NVMe go to the drive, not host memory."""
        for c in self.streamed():
            c.shard_lo, c.shard_hi, c.shard_size = self.dp.shard(c.numel)
        if self.nvme is not None:
            self.nvme.open(self.offloaded(), master_separate=self.half)
        for c in self.chunks:
            if c.persistent:
                c.data = torch.empty(c.numel, dtype=self.dtype, device=self.device)
                c.grad = torch.zeros(c.numel, dtype=torch.float32, device=self.device)
                for s in c.slots:
                    c.data[s.offset:s.stop].copy_(s.param.data.reshape(-1))
                c.master = c.data.float() if self.half else c.data
                c.exp_avg = torch.zeros(c.numel, dtype=torch.float32, device=self.device)
                c.exp_avg_sq = torch.zeros(c.numel, dtype=torch.float32, device=self.device)
                c.state = ChunkState.RESIDENT
            else:
                flat = torch.zeros(c.shard_size, dtype=self.dtype)
                for sl in c.slots:    # this rank's part of each parameter
                    a, b = max(sl.offset, c.shard_lo), min(sl.stop, c.shard_hi)
                    if a < b:
                        flat[a - c.shard_lo:b - c.shard_lo].copy_(
                            sl.param.data.detach().reshape(-1)[a - sl.offset:b - sl.offset])
                on_nvme = self.nvme is not None and c in self.nvme
                # A sharded persistent chunk's shard lives on the device, an offloaded one's
                # in pinned host memory (the copies' source and target).
                home = ((lambda n, dtype, what: torch.empty(n, dtype=dtype, device=self.device))
                        if c.sharded else self.streams.pinned)
                if self.half:
                    c.shadow = home(c.shard_size, self.dtype, f"chunk {c.index}'s parameters")
                    c.shadow.copy_(flat)
                    c.master = None if on_nvme else flat.to(c.shadow.device, torch.float32)
                else:
                    c.master = home(c.shard_size, torch.float32,
                                    f"chunk {c.index}'s parameters (their fp32 master)")
                    c.master.copy_(flat)
                if grad_accumulation or not self.half:
                    c.grad_acc = home(c.shard_size, torch.float32, f"chunk {c.index}'s fp32 gradients")
                    c.grad_acc.zero_()
                if on_nvme:
                    self.nvme.store_initial(c, flat if self.half else None)
                else:
                    c.exp_avg = torch.zeros(c.shard_size, dtype=torch.float32, device=c.master.device)
                    c.exp_avg_sq = torch.zeros(c.shard_size, dtype=torch.float32, device=c.master.device)
                del flat
            self._point_params(c)

    def on_nvme(self, c: Chunk) -> bool:
        """Whether ``c``'s optimizer states live on the drive (held in a staging buffer only
        while CPU Adam or a checkpoint uses them)."""
        return self.nvme is not None and c in self.nvme

    @contextmanager
    def host_states(self, c: Chunk, *, write: bool = False):
        """``c``'s master, exp_avg and exp_avg_sq readable (and writable) in the body, for
        checkpoints and re-plans: where they are for a host or device chunk; read from the
        drive into a staging buffer, and written back with ``write``, for a chunk on NVMe."""
        if self.on_nvme(c):
            with self.nvme.loaded(c, write=write):
                yield
        else:
            yield

    def host_params(self, c: Chunk) -> torch.Tensor:
        """The host region the parameters of an offloaded chunk are uploaded from."""
        return c.shadow if self.half else c.master

    def _point_params(self, c: Chunk) -> None:
        if c.persistent:
            base = c.data
        elif c.state in (ChunkState.RESIDENT, ChunkState.UPLOADING, ChunkState.CACHED):
            base = self.pool.tensors[c.buffer]
        elif self.dp.world > 1:
            for s in c.slots:          # sharded and not resident: no full values on this rank
                s.param.data = self._empty
            return
        else:
            base = self.host_params(c)
        for s in c.slots:
            s.param.data = base[s.offset:s.stop].view(s.shape)

    # ---- residency -----------------------------------------------------------------------
    def offloaded(self) -> list[Chunk]:
        """The chunks whose states live in host memory (or on the drive): CPU Adam's."""
        return [c for c in self.chunks if not c.persistent and not c.sharded]

    def sharded(self) -> list[Chunk]:
        """The sharded persistent chunks (states on the device, 1/world each)."""
        return [c for c in self.chunks if c.sharded]

    def streamed(self) -> list[Chunk]:
        """The chunks gathered into buffers ahead of use: offloaded and sharded persistent."""
        return [c for c in self.chunks if not c.persistent]

    def device_states_written(self, c: Chunk) -> None:
        """The compute queue wrote a sharded chunk's device states (an update, a load): its
        next upload (on the upload queue) waits for that write."""
        if c.sharded:
            c.updated = self.streams.compute_wrote(
                *(t for t in (c.shadow, c.master, c.grad_acc) if t is not None))

    def can_upload(self) -> bool:
        return bool(self.pool.free)

    def upload(self, c: Chunk) -> None:
        """Start bringing an offloaded chunk into the oldest free buffer (or reuse its own
        buffer if it is still cached there)."""
        if c.persistent or c.state in (ChunkState.RESIDENT, ChunkState.UPLOADING):
            return
        if c.state == ChunkState.CACHED:
            self.pool.take(c.buffer)
            c.move(ChunkState.RESIDENT)
            return
        self.host_ready(c)         # its CPU Adam update of the last step may still be running
        if not self.pool.free:
            raise RuntimeError(
                f"chunk {c.index} is needed but all {len(self.pool)} buffers are in use; the plan's "
                f"n_buffer is below what this model's forward needs (re-plan, or pin a larger "
                f"n_buffer)")
        b = self.pool.free.popleft()
        prev = self.pool.owner[b]
        if prev is not None and prev is not c and prev.state == ChunkState.CACHED:
            prev.move(ChunkState.HOST)
            prev.buffer = None
            self._point_params(prev)
        self.pool.owner[b] = c
        c.buffer = b
        c.move(ChunkState.UPLOADING)
        buf = self.pool.tensors[b]
        mine = buf[self.dp.rank * c.shard_size:(self.dp.rank + 1) * c.shard_size]
        t = self.tracer.now() if self.tracer is not None else 0.0
        after = self.pool.free_after[b] if c.updated is None else [self.pool.free_after[b], c.updated]
        c.ready = self.streams.copy(mine, self.host_params(c), "upload", after=after)
        if self.tracer is not None:
            self.tracer.add("h2d", "upload", f"chunk {c.index}", t, self.tracer.now())
        if self.dp.world > 1:
            with self.streams.side("upload"):
                self.dp.all_gather_(buf, c.shard_size)
                c.ready = self.streams.record_on("upload")
        self._point_params(c)

    def access(self, c: Chunk) -> None:
        """Make a chunk usable by the compute stream now."""
        if c.persistent:
            return
        if c.state in (ChunkState.HOST, ChunkState.CACHED):
            self.upload(c)
        if c.state == ChunkState.UPLOADING:
            self.streams.wait(c.ready)
            c.move(ChunkState.RESIDENT)
        if c.state != ChunkState.RESIDENT:
            raise RuntimeError(f"chunk {c.index} cannot be used in state {c.state.value}")

    def release(self, c: Chunk) -> None:
        """Forward is done with the chunk: its buffer may be reused, its data stays until then."""
        if c.persistent or c.state != ChunkState.RESIDENT:
            return
        c.move(ChunkState.CACHED)
        self.pool.release(c.buffer, self.streams.compute_event())

    def offload_grads(self, c: Chunk, target: torch.Tensor, check=None, accumulate: bool = False) -> None:
        """The chunk's backward is done: its buffer holds its gradients (parameters without a
        gradient are zeroed first); with several ranks they are summed and averaged into this
        rank's shard (reduce-scatter); the shard is copied to ``target`` on the offload queue
        and the buffer is free once the copy is done. ``check(c, shard)``: called with this
        rank's gradients on the device, on the queue that made them; it returns (host, device),
        a small result copied to the host on the offload queue just before the gradients: on
        the host once ``c.grads_on_host`` has happened, read with no synchronisation of its
        own (the caller keeps ``device`` alive until then). ``accumulate``: the shard is added
        to ``target`` instead (a device target: a sharded chunk's accumulator)."""
        buf = self.pool.tensors[c.buffer]
        for s in c.slots:
            if not s.has_grad:
                buf[s.offset:s.stop].zero_()
        if self.dp.world > 1:
            buf[c.numel:self.dp.world * c.shard_size].zero_()   # the reduce-scatter reads it
        c.move(ChunkState.GRADS)
        if self.dp.world > 1:
            after = self.streams.compute_event()     # after every write above
            with self.streams.side("offload", after=after):
                mine = self.dp.reduce_scatter_(buf, c.shard_size)
                mine.div_(self.dp.world)          # DeepSpeed averages gradients over ranks
                verdict = check(c, mine) if check is not None else None
                after = self.streams.record_on("offload")
        else:
            mine = buf[:c.numel]
            verdict = check(c, mine) if check is not None else None
            # after every write above and the check's reads: the buffer is reused once the
            # copy (which waits for this) is done
            after = self.streams.compute_event()
        t = self.tracer.now() if self.tracer is not None else 0.0
        if verdict is not None:
            self.streams.copy(*verdict, "offload", after=after)   # FIFO: before the gradients
        if accumulate:
            with self.streams.side("offload", after=after):
                target.add_(mine)
                done = self.streams.record_on("offload")
        else:
            done = self.streams.copy(target, mine, "offload", after=after)
        if self.tracer is not None:
            self.tracer.add("d2h", "offload", f"chunk {c.index}", t, self.tracer.now())
        c.grads_on_host = done
        self.pool.owner[c.buffer] = None
        self.pool.release(c.buffer, done)
        c.buffer = None
        c.move(ChunkState.HOST)
        self._point_params(c)

    def evict(self, c: Chunk) -> None:
        """Drop the buffered copy of an offloaded chunk (its host states are about to change):
        its next use uploads it again, after its update (``upload`` waits for it)."""
        if c.state == ChunkState.UPLOADING:
            self.access(c)
        if c.state == ChunkState.RESIDENT:
            self.release(c)
        if c.state == ChunkState.CACHED:
            self.pool.owner[c.buffer] = None
            c.buffer = None
            c.move(ChunkState.HOST)
            self._point_params(c)
        elif c.state == ChunkState.GRADS:
            raise RuntimeError(f"chunk {c.index} still has gradients in flight; finish the step first")

    def evict_all(self) -> None:
        """Drop every buffered copy (their host states are about to change)."""
        for c in self.streamed():
            self.evict(c)

    # ---- accounting ------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Device bytes the chunks hold (persistent states, whole or sharded, and buffers)."""
        total = sum(t.numel() * t.element_size() for t in self.pool.tensors)
        for c in self.chunks:
            if c.persistent or c.sharded:
                tensors = {id(t): t for t in (c.data, c.grad, c.shadow, c.grad_acc, c.master,
                                              c.exp_avg, c.exp_avg_sq) if t is not None}
                total += sum(t.numel() * t.element_size() for t in tensors.values())
        return total

    def host_bytes(self) -> int:
        """Host bytes the offloaded chunks hold: parameters, gradients, and the optimizer
        states of those not on NVMe (theirs: the staging ring)."""
        total = self.nvme.staging_bytes() if self.nvme is not None else 0
        for c in self.offloaded():
            states = () if self.on_nvme(c) else (c.master, c.exp_avg, c.exp_avg_sq)
            if self.on_nvme(c) and not self.half:
                states = (c.master,)                    # fp32: the master is the parameters
            tensors = {id(t): t for t in (c.shadow, c.grad_acc, *states) if t is not None}
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        return total

    def host_state_bytes(self) -> int:
        """Host bytes of offloaded chunks' optimizer states - exp_avg, exp_avg_sq, and the
        fp32 master where it is separate from the parameters (16-bit training) - plus the
        staging ring those on NVMe pass through."""
        total = self.nvme.staging_bytes() if self.nvme is not None else 0
        for c in self.offloaded():
            if not self.on_nvme(c):
                states = (c.master, c.exp_avg, c.exp_avg_sq) if self.half else (c.exp_avg, c.exp_avg_sq)
                total += sum(t.numel() * t.element_size() for t in states if t is not None)
        return total

    def gathered(self, chunks: list[Chunk] | None = None, *, what: str = "state_dict",
                 timeout_s: float | None = None, fix: str = "") -> dict[nn.Parameter, torch.Tensor]:
        """The full current value of each parameter of the offloaded ``chunks`` (default: all),
        when shards hold them (several ranks; empty with one: every parameter's tensor holds its
        value then), each in a tensor of its own on the host, in the training dtype. A
        collective: every rank must call it, with the same chunks (``what`` names the call, and
        ``fix`` the way out, in the error a call on some ranks only gets after ``timeout_s``:
        DataParallel.rendezvous). The layout is left as it is."""
        out: dict[nn.Parameter, torch.Tensor] = {}
        if self.dp.world == 1:
            return out
        self.dp.rendezvous(what, timeout_s, fix)
        self.host_sync()
        for c in (self.chunks if chunks is None else chunks):
            if c.persistent:
                continue
            full = self._full_values(c)
            for s in c.slots:
                out[s.param] = full[s.offset:s.stop].view(s.shape).clone()
        return out

    def _full_values(self, c: Chunk) -> torch.Tensor:
        """An offloaded chunk's host values, all shards (an all-gather; on the host)."""
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        full = torch.empty(self.dp.world * c.shard_size, dtype=self.dtype, device=dev)
        full[self.dp.rank * c.shard_size:(self.dp.rank + 1) * c.shard_size].copy_(self.host_params(c))
        self.dp.all_gather_(full, c.shard_size)
        return full.cpu()

    def close(self, to_host: bool = False, gather: bool = True) -> None:
        """Leave every parameter as a standalone tensor holding its current value (persistent
        ones on the device, offloaded ones on the host; all on the host with ``to_host``) and
        drop every chunk tensor, device and host, so their memory is given back now (a re-plan
        allocates new chunks right after). With several ranks the shards are gathered first:
        every rank must call it (or pass ``gather=False``, at interpreter shutdown, to drop
        sharded values instead)."""
        world = self.dp.world
        if world > 1 and not gather:
            self._drop()
            return
        if world > 1 and self.streamed():
            self.dp.rendezvous("closing the runtime (engine.destroy() gathers the shards)")
        self.evict_all()
        for c in self.chunks:
            if c.persistent or world == 1:
                for s in c.slots:
                    s.param.data = s.param.data.to("cpu", copy=True) if to_host else s.param.data.clone()
                continue
            full = self._full_values(c)
            for s in c.slots:
                s.param.data = full[s.offset:s.stop].clone().view(s.shape)
        self._drop()

    def _drop(self) -> None:
        if self.nvme is not None:
            self.nvme.close()               # its store's I/O done before its buffers go
        self.streams.release_pinned()       # waits for the copies still queued first
        self.pool.tensors = []
        self.pool.owner = [None] * len(self.pool.owner)
        for c in self.chunks:
            c.data = c.grad = c.shadow = c.grad_acc = c.master = c.exp_avg = c.exp_avg_sq = None
            c.ready = c.grads_on_host = c.updated = None
