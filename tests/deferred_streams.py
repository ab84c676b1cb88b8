"""Streams that follow the latest legal CUDA schedule, on CPU: a check of the runtime's waits.

On CUDA a copy queued on a side stream runs at some time after its dependencies and before
whatever waits on its event; meanwhile its destination holds garbage and its source must not
change. The runtime's CPU path copies synchronously, so a missing wait cannot show there.
DeferredStreams plays the schedules CUDA may play, so that such a bug changes training:

- side queues run late: every side-queue copy runs only when something waits on it (the
  compute stream, a host thread, or a later copy that depends on it). Its destination is
  poisoned (NaN / 0xFF bytes) as soon as its dependencies are met, as a real copy engine would
  be mid-write. A read before the wait sees the poison; a source changed before the wait is
  copied with its new value.
- the compute queue runs late too: a side-queue operation only waits for the compute work
  queued before the compute events it (transitively) waits for. Compute is eager here, so the
  harness watches the version counters of the device tensors side work reads; if compute
  wrote one after the last compute event the side work waits for, CUDA may run the side work
  before that write: its outputs are poisoned (``races`` counts it). Writes are seen through
  the tensor a side operation names and its views (e.g. a chunk buffer and its slices).
- an allocator that reuses freed blocks at once: a queued copy holds its device operands
  weakly, as CUDA's caching allocator does (it hands a block to the next allocation as soon
  as the last tensor on it is dropped, whatever side stream still uses it). A copy reading a
  freed block copies poison; one writing a freed block would corrupt its next owner and is
  reported (``DeviceOrderError``).
- the host does not wait when the compute stream does: ``wait`` (compute waits for a copy)
  runs the copy, so that eager compute sees its result, but does not tell the host it is
  done. Only a host wait (``host_wait``, an event's ``synchronize``, ``synchronize``) or a
  later copy ordered after it does. Until then a device-to-host copy's destination keeps its
  poison (the copy engine may not have written it yet: the host reads garbage), and the
  host memory a copy reads or writes counts as in use.
- pinned memory is registered as with cudaHostRegister (``pinned_bytes`` is what is held);
  unregistering a region a copy may still use (the host has not waited for it) is reported.
- a helper thread that uses the device without selecting it first (``bind_thread``) is
  reported: on a multi-GPU node it would create a context on, and queue work for, GPU 0.
- host reads of device data (``to_host``, the runtime's one way to read it) are counted per
  thread (``host_reads``): each one is a host-device synchronisation on CUDA.

Host work runs on the optimizer's worker thread as it does with a GPU, so the CPU Adam
overlapping backward is exercised too (copies forced from either thread, under one lock).

``Held`` measures memory actually held: the bytes of given tensors' storages still alive.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from protrain.runtime.host_limits import check_pinning
from protrain.runtime.streams import Streams


class DeviceOrderError(AssertionError):
    """The runtime did something CUDA would turn into corrupted memory or a wrong device."""


class _Queue:
    def __init__(self, name: str, lock: threading.RLock):
        self.name = name
        self.lock = lock
        self.ops: list = []
        self.deps: list[int] = []
        """Per op: the last compute event it transitively waits for (its own waits, those of
        the events it waits for, and its queue's earlier ops)."""
        self.done = 0
        self.hooks: dict[int, list] = {}
        """Callbacks to run once op n (1-based count) has run."""
        self.waits: list[list] = []
        """Per op: the events it waits for (a host that knows it is done knows those are)."""
        self.ranges: list[list[tuple[int, int]]] = []
        """Per op: the host (pinned) address ranges it reads or writes."""
        self.staged: dict[int, tuple] = {}
        """Op n's result for host memory, not yet visible to the host: (destination, value)."""
        self.published = 0
        """Ops whose host-memory results are written (something ordered after them ran)."""
        self.acked = 0
        """Ops the host has waited for (directly or through something ordered after them)."""

    def push(self, op, dep: int, waits=(), ranges=()) -> int:
        with self.lock:
            self.ops.append(op)
            self.deps.append(max(dep, self.dep_of(len(self.deps))))
            self.waits.append(list(waits))
            self.ranges.append(list(ranges))
            return len(self.ops)

    def dep_of(self, n: int) -> int:
        return self.deps[n - 1] if n > 0 else 0

    def run_until(self, n: int) -> None:
        with self.lock:
            while self.done < n:
                op, self.ops[self.done] = self.ops[self.done], None
                self.done += 1
                op()
                for hook in self.hooks.pop(self.done, []):
                    hook()

    def publish_until(self, n: int) -> None:
        """Ops up to n are complete on the device: their results are in host memory."""
        with self.lock:
            self.run_until(n)
            while self.published < n:
                self.published += 1
                dst, value = self.staged.pop(self.published, (None, None))
                if dst is not None:
                    dst.copy_(value)

    def pending(self) -> int:
        return len(self.ops) - self.done

    def unacked_ranges(self):
        """Host ranges of the ops the host has not waited for."""
        for r in self.ranges[self.acked:]:
            yield from r


class _Event:
    """A point in a side queue, or (queue None) compute event number ``n``."""

    def __init__(self, owner: "DeferredStreams", queue: _Queue | None = None, n: int = 0):
        self.owner, self.queue, self.n = owner, queue, n

    def compute_dep(self) -> int:
        return self.n if self.queue is None else self.queue.dep_of(self.n)

    def query(self) -> bool:
        return self.queue is None or self.queue.done >= self.n

    def run(self) -> None:
        """The compute stream waits for the event: what compute reads or overwrites next is
        the copies' business first (they run), but the host learns nothing."""
        if self.queue is not None:
            self.queue.run_until(self.n)

    def complete(self) -> None:
        """Something ordered after the event on the device runs: the copies up to it are done,
        their results in host memory."""
        if self.queue is not None:
            self.queue.publish_until(self.n)

    def synchronize(self) -> None:
        """The host waits for the event (CUDA's event.synchronize)."""
        self.owner._check_thread("waited for an event")
        self.complete()
        self.owner._ack(self)

    def on_done(self, fn) -> None:
        with self.queue.lock:
            if self.query():
                fn()
            else:
                self.queue.hooks.setdefault(self.n, []).append(fn)


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-1 if t.dtype.is_signed else 0xFF)


def _base(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


class _Operand:
    """A copy's operand as a queued CUDA copy holds it: host (pinned) memory strongly, device
    memory only weakly (the caching allocator does not wait for side streams)."""

    def __init__(self, t: torch.Tensor, host: bool):
        self.host = host
        if host:
            self.tensor = t
        else:
            self.storage = weakref.ref(t.untyped_storage())
            self.view = (t.dtype, t.storage_offset(), t.size(), t.stride())

    def get(self) -> torch.Tensor | None:
        if self.host:
            return self.tensor
        st = self.storage()
        if st is None:
            return None
        dtype, off, size, stride = self.view
        # A tensor of its own, with its own version counter: what the harness writes through
        # it is not taken for a compute write to the watched tensor it views. Made outside any
        # dispatch mode: a device meter (the runtime's accounting) would take the storage it
        # is set to for a new allocation.
        with _disable_current_modes():
            return torch.empty(0, dtype=dtype).set_(st, off, size, stride)


class _Watch:
    """Version counter of a device tensor side work reads: ``tag`` is the compute event after
    which compute last wrote it."""

    __slots__ = ("ref", "version", "tag")

    def __init__(self, t: torch.Tensor):
        self.ref = weakref.ref(t)
        self.version = t._version
        self.tag = 0


class _SideReads(TorchDispatchMode):
    """Inside a side-queue context: the tensors each operation reads, checked for compute
    writes the context does not wait for; outputs of an operation that read one are poisoned."""

    def __init__(self, owner: "DeferredStreams", dep: int):
        super().__init__()
        self.owner, self.dep = owner, dep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        raced = any(self.owner._tag(a) > self.dep for a in inputs)
        out = func(*args, **kwargs)
        if raced:
            self.owner.races += 1
            written = [a for a, s in zip(args, func._schema.arguments)
                       if isinstance(a, torch.Tensor) and s.alias_info is not None and s.alias_info.is_write]
            for t in written + [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]:
                with torch.no_grad():
                    _poison(t)
        return out


class DeferredStreams(Streams):
    def __init__(self, device: torch.device):
        super().__init__(device)
        self.asynchronous = True
        self.lock = threading.RLock()
        self.queues = {q: _Queue(q, self.lock) for q in ("upload", "offload")}
        self.copies = 0
        self.most_pending = 0
        """Largest number of copies queued and not yet run at once (> 0: something overlapped)."""
        self.races = 0
        """Side work that read a device tensor compute wrote after the events it waits for."""
        self.freed_reads = 0
        """Queued copies whose device source was freed before they ran (they copied poison)."""
        self.registrations = 0
        """cudaHostRegister calls (``pinned``)."""
        self.host_reads: list[str] = []
        """The thread of each host read of device data (``to_host``): on CUDA each one waits
        for the work queued on the reading thread's stream (a host-device synchronisation)."""
        self._compute_seq = 0
        self._compute_waits: list[tuple[int, _Event]] = []
        """(compute events recorded before it, event) per compute wait the host has not
        learnt the end of."""
        self._watch: dict[int, _Watch] = {}
        self._host_ranges: dict[int, tuple[int, int]] = {}
        self._bound = {threading.get_ident()}

    # ---- checks ---------------------------------------------------------------------------
    def bind_thread(self) -> None:
        self._bound.add(threading.get_ident())

    def _check_thread(self, what: str) -> None:
        if threading.get_ident() not in self._bound:
            raise DeviceOrderError(
                f"thread {threading.current_thread().name} {what} without selecting the device "
                f"(Streams.bind_thread): on a multi-GPU node it would use GPU 0")

    def _is_host(self, t: torch.Tensor) -> bool:
        p = t.data_ptr()
        return any(lo <= p < hi for lo, hi in self._host_ranges.values())

    def _watch_tensor(self, t: torch.Tensor) -> None:
        b = _base(t)
        if id(b) not in self._watch or self._watch[id(b)].ref() is not b:
            self._watch[id(b)] = _Watch(b)

    def _scan(self) -> None:
        """Attribute writes seen since the last scan to compute, before the next compute event."""
        for k, w in list(self._watch.items()):
            t = w.ref()
            if t is None:
                del self._watch[k]
            elif t._version != w.version:
                w.version, w.tag = t._version, self._compute_seq + 1

    def _tag(self, t: torch.Tensor) -> int:
        w = self._watch.get(id(_base(t)))
        return w.tag if w is not None and w.ref() is _base(t) else 0

    def _raced(self, t: torch.Tensor, dep: int) -> bool:
        self._scan()
        return self._tag(t) > dep

    # ---- queues ---------------------------------------------------------------------------
    def _events(self, after) -> list[_Event]:
        return [e for e in (after if isinstance(after, (list, tuple)) else [after]) if e is not None]

    def compute_event(self):
        self._check_thread("recorded a compute event")
        with self.lock:
            self._scan()
            self._compute_seq += 1
            return _Event(self, None, self._compute_seq)

    def compute_wrote(self, *tensors):
        """Compute wrote ``tensors`` just now, unseen by their version counters (a native
        kernel): side work that reads them without waiting for the event returned races."""
        with self.lock:
            self._scan()
            for t in tensors:
                self._watch_tensor(t)
                self._watch[id(_base(t))].tag = self._compute_seq + 1
            return self.compute_event()

    def copy(self, dst, src, queue, after=None):
        self._check_thread("queued a copy")
        deps = self._events(after)
        q = self.queues[queue]
        d_op, s_op = _Operand(dst, self._is_host(dst)), _Operand(src, self._is_host(src))
        with self.lock:
            for t, op in ((dst, d_op), (src, s_op)):
                if not op.host:
                    self._watch_tensor(t)
            dep = max([e.compute_dep() for e in deps] + [0])
            ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                      for t, op in ((dst, d_op), (src, s_op)) if op.host]
            # The watched tensor the source views (the operand rebuilds a tensor of its own).
            watched = None if s_op.host else weakref.ref(_base(src))
            n = q.push(None, dep, deps, ranges)
            self.copies += 1
            self.most_pending = max(self.most_pending, sum(x.pending() for x in self.queues.values()))

            def run():
                for e in deps:
                    e.complete()
                d = d_op.get()
                if d is None:
                    raise DeviceOrderError(f"a queued {queue} copy writes device memory that was freed "
                                           f"before it ran (the allocator gives it to the next tensor)")
                s = s_op.get()
                if s is None:
                    self.freed_reads += 1
                    _poison(d)
                elif not s_op.host and watched() is not None and self._raced(watched(), q.dep_of(n)):
                    self.races += 1
                    _poison(d)
                elif d_op.host:
                    # Read now (compute may overwrite the source once it waited), visible in
                    # host memory only when something ordered after the copy runs.
                    value = torch.empty_like(d)
                    value.copy_(s)
                    q.staged[n] = (d, value)
                else:
                    d.copy_(s)
            q.ops[n - 1] = run
            waiting = [e for e in deps if not e.query()]
            poisoned = [False]

            def poison():
                if not poisoned[0] and all(e.query() for e in deps) and q.done < n:
                    d = d_op.get()
                    if d is not None:
                        poisoned[0] = True
                        _poison(d)
            if waiting:
                for e in waiting:
                    e.on_done(poison)
            else:
                poison()
        return _Event(self, q, n)

    def record_on(self, queue):
        self._check_thread("recorded a side-queue event")
        q = self.queues[queue]
        with self.lock:
            return _Event(self, q, len(q.ops))

    def wait(self, event) -> None:
        """The compute stream waits; the host goes on (see the module docstring)."""
        self._check_thread("made the compute stream wait")
        if event is not None:
            event.run()
            with self.lock:
                self._compute_waits.append((self._compute_seq, event))

    def host_wait(self, event) -> None:
        self._check_thread("waited for an event on the host")
        if event is not None:
            event.synchronize()

    def _ack(self, event: "_Event") -> None:
        """The host knows ``event`` happened, and so everything ordered before it: earlier ops
        of its queue, the events they waited for, and the copies compute waited for before a
        compute event it waited for."""
        with self.lock:
            todo = [event]
            while todo:
                e = todo.pop()
                if e.queue is None:
                    before = [w for seq, w in self._compute_waits if seq < e.n]
                    self._compute_waits = [(seq, w) for seq, w in self._compute_waits if seq >= e.n]
                    todo.extend(before)
                    continue
                q = e.queue
                q.publish_until(e.n)
                while q.acked < e.n:
                    todo.extend(q.waits[q.acked])
                    q.acked += 1

    @contextmanager
    def side(self, queue, after=None):
        """Work in the context runs now, after the queue's earlier work; the tensors it reads
        are checked against compute writes it does not wait for."""
        self._check_thread("ran work on a side queue")
        self.wait(after)
        q = self.queues[queue]
        # Under the lock: no copy runs meanwhile, so every write seen during the context is
        # the context's own (side work), and every write before it was compute's.
        with self.lock:
            q.publish_until(len(q.ops))
            dep = max(after.compute_dep() if after is not None else 0, q.dep_of(len(q.ops)))
            n = q.push(lambda: None, dep, [after] if after is not None else [])
            q.publish_until(n)
            self._scan()
            with _SideReads(self, q.dep_of(n)):
                yield
            for w in self._watch.values():
                t = w.ref()
                if t is not None:
                    w.version = t._version

    def synchronize(self) -> None:
        self._check_thread("synchronized the device")
        for q in self.queues.values():
            self._ack(_Event(self, q, len(q.ops)))
        with self.lock:
            self._compute_waits = []

    def pending(self) -> int:
        return sum(q.pending() for q in self.queues.values())

    def to_host(self, t):
        self._check_thread("read device data")
        with self.lock:
            self.host_reads.append(threading.current_thread().name)
        return t.clone()

    def copy_in_thread(self, dst, src) -> None:
        self._check_thread("copied from a helper thread")
        dst.copy_(src)

    # ---- pinned memory ----------------------------------------------------------------------
    def pinned(self, numel: int, dtype: torch.dtype, what: str = "a host buffer") -> torch.Tensor:
        check_pinning(numel * dtype.itemsize, what)     # refused as Streams refuses it
        t = torch.empty(numel, dtype=dtype)      # registered as Streams does on CUDA
        if numel and self._register(t):
            self._registered.append(t)
        return t

    def pinned_bytes(self) -> int:
        """Bytes registered and not unregistered."""
        return sum(hi - lo for lo, hi in self._host_ranges.values())

    def _register(self, t: torch.Tensor) -> bool:
        self.registrations += 1
        p = t.data_ptr()
        self._host_ranges[id(t)] = (p, p + t.numel() * t.element_size())
        return True

    def _unregister(self, t: torch.Tensor) -> None:
        lo, hi = self._host_ranges[id(t)]
        with self.lock:
            for q in self.queues.values():
                if any(a < hi and lo < b for a, b in q.unacked_ranges()):
                    # refused: the region stays registered (host memory, as the copy uses it)
                    raise DeviceOrderError(f"pinned memory unregistered while a {q.name} copy may "
                                           f"still use it (the host has not waited for it)")
        del self._host_ranges[id(t)]


class Held:
    """Memory actually held: weak references to storages, and how many of their bytes are
    still alive (for checks such as "nothing of the failed step survives a re-plan")."""

    def __init__(self):
        self._refs: dict[int, tuple[weakref.ref, int]] = {}

    def add(self, *tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                st = t.untyped_storage()
                self._refs[id(st)] = (weakref.ref(st), st.nbytes())

    def bytes_alive(self) -> int:
        return sum(n for ref, n in self._refs.values() if ref() is not None)


@contextmanager
def deferred_streams(monkeypatch):
    """Make every runtime (and profiler) built inside the context use DeferredStreams; yields
    the list of the instances made."""
    made: list[DeferredStreams] = []

    def factory(device):
        s = DeferredStreams(device)
        made.append(s)
        return s
    import protrain.measure.profiler as profiler_mod
    import protrain.runtime.runtime as rt_mod
    import protrain_megatron.policy as policy_mod
    monkeypatch.setattr(rt_mod, "Streams", factory)
    monkeypatch.setattr(policy_mod, "Streams", factory)
    monkeypatch.setattr(profiler_mod, "Streams", factory, raising=False)
    yield made
