"""Streams that follow the latest legal CUDA schedule, on CPU: a check of the runtime's waits.

On CUDA a copy queued on a side stream runs at some time after its dependencies and before
whatever waits on its event; meanwhile its destination holds garbage and its source must not
change. The runtime's CPU path copies synchronously, so a missing wait cannot show there.
DeferredStreams runs every side-queue copy as late as CUDA may: only when something waits on
it (the compute stream, a host thread, or a later copy that depends on it). Its destination is
poisoned (NaN / 0xFF bytes) as soon as its dependencies are met, as a real copy engine would be
mid-write. So a read before the wait sees the poison, and a source changed before the wait is
copied with its new value: training then stops matching the synchronous run, bit for bit.

Host work runs on the optimizer's worker thread as it does with a GPU, so the CPU Adam
overlapping backward is exercised too (copies forced from either thread, under one lock).

Compute is eager (every compute event has happened when it is recorded); a side-queue context
(collectives) runs its work eagerly after the queue's earlier copies.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

from protrain.runtime.streams import Streams


class _Queue:
    def __init__(self, name: str, lock: threading.RLock):
        self.name = name
        self.lock = lock
        self.ops: list = []
        self.done = 0
        self.hooks: dict[int, list] = {}
        """Callbacks to run once op n (1-based count) has run."""

    def push(self, op) -> int:
        with self.lock:
            self.ops.append(op)
            return len(self.ops)

    def run_until(self, n: int) -> None:
        with self.lock:
            while self.done < n:
                op, self.ops[self.done] = self.ops[self.done], None
                self.done += 1
                op()
                for hook in self.hooks.pop(self.done, []):
                    hook()

    def pending(self) -> int:
        return len(self.ops) - self.done


class _Event:
    """A point in a queue (None: the compute stream, always already reached)."""

    def __init__(self, queue: _Queue | None = None, n: int = 0):
        self.queue, self.n = queue, n

    def query(self) -> bool:
        return self.queue is None or self.queue.done >= self.n

    def synchronize(self) -> None:
        if self.queue is not None:
            self.queue.run_until(self.n)

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


class DeferredStreams(Streams):
    def __init__(self, device: torch.device):
        super().__init__(device)
        self.asynchronous = True
        self.lock = threading.RLock()
        self.queues = {q: _Queue(q, self.lock) for q in ("upload", "offload")}
        self.copies = 0
        self.most_pending = 0
        """Largest number of copies queued and not yet run at once (> 0: something overlapped)."""

    @staticmethod
    def _events(after) -> list[_Event]:
        return [e for e in (after if isinstance(after, (list, tuple)) else [after]) if e is not None]

    def compute_event(self):
        return _Event()

    def copy(self, dst, src, queue, after=None):
        deps = self._events(after)
        q = self.queues[queue]

        def run():
            for e in deps:
                e.synchronize()
            dst.copy_(src)

        with self.lock:
            n = q.push(run)
            self.copies += 1
            self.most_pending = max(self.most_pending, sum(x.pending() for x in self.queues.values()))
            waiting = [e for e in deps if not e.query()]
            poisoned = [False]

            def poison():
                if not poisoned[0] and all(e.query() for e in deps) and q.done < n:
                    poisoned[0] = True
                    _poison(dst)
            if waiting:
                for e in waiting:
                    e.on_done(poison)
            else:
                poison()
        return _Event(q, n)

    def record_on(self, queue):
        q = self.queues[queue]
        with self.lock:
            return _Event(q, len(q.ops))

    def wait(self, event) -> None:
        if event is not None:
            event.synchronize()

    def host_wait(self, event) -> None:
        self.wait(event)

    @contextmanager
    def side(self, queue, after=None):
        self.wait(after)
        q = self.queues[queue]
        q.run_until(len(q.ops))
        yield

    def synchronize(self) -> None:
        for q in self.queues.values():
            q.run_until(len(q.ops))

    def pending(self) -> int:
        return sum(q.pending() for q in self.queues.values())


@contextmanager
def deferred_streams(monkeypatch):
    """Make every runtime built inside the context use DeferredStreams; yields the list of the
    instances made."""
    made: list[DeferredStreams] = []

    def factory(device):
        s = DeferredStreams(device)
        made.append(s)
        return s
    import protrain.runtime.runtime as rt_mod
    import protrain_megatron.policy as policy_mod
    monkeypatch.setattr(rt_mod, "Streams", factory)
    monkeypatch.setattr(policy_mod, "Streams", factory)
    yield made
