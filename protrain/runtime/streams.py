"""The runtime's queues: compute, upload (H2D) and offload (D2H).

The cost model assumes one FIFO per copy direction next to compute: chunk uploads and swap
prefetches share the upload queue in issue order, gradients and swap-outs share the offload
queue. On CUDA these are two side streams synchronised with events; on CPU (tests) there are
no streams: every copy is synchronous and every event is None, so the same code paths run.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch


class Streams:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.asynchronous = self.cuda
        """Copies may still be in flight when ``copy`` returns (host work can then overlap)."""
        self._registered: list[torch.Tensor] = []
        if self.cuda:
            self.upload = torch.cuda.Stream(device)
            self.offload = torch.cuda.Stream(device)

    def compute_event(self):
        """An event marking everything queued on the compute stream so far."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def copy(self, dst: torch.Tensor, src: torch.Tensor, queue: str, after=None):
        """Copy ``src`` into ``dst`` on the ``upload`` or ``offload`` queue once ``after`` (an
        event or a list of events) has happened; returns the event of the copy's end."""
        if not self.cuda:
            dst.copy_(src)
            return None
        stream = self.upload if queue == "upload" else self.offload
        for ev in (after if isinstance(after, (list, tuple)) else [after]):
            if ev is not None:
                stream.wait_event(ev)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def record_on(self, queue: str):
        """An event at the current end of a side queue (None on CPU)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.upload if queue == "upload" else self.offload)
        return ev

    def wait(self, event) -> None:
        """Make the compute stream wait for ``event`` (no host blocking)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def host_wait(event) -> None:
        """Block the calling host thread until ``event`` has happened."""
        if event is not None:
            event.synchronize()

    def side(self, queue: str, after=None):
        """Context that runs work on a side queue once ``after`` (an event) has happened
        (no-op on CPU)."""
        if not self.cuda:
            return nullcontext()
        stream = self.upload if queue == "upload" else self.offload
        if after is not None:
            stream.wait_event(after)
        return torch.cuda.stream(stream)

    def synchronize(self) -> None:
        """Block until every queued copy and kernel is done."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory for copies: page-locked on CUDA, plain on CPU. Registered with
        cudaHostRegister rather than taken from torch's pinned caching allocator, which rounds
        every block up to a power of two (up to 2x the host memory the plan counted)."""
        t = torch.empty(numel, dtype=dtype)
        if self.cuda and numel:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(
                t.data_ptr(), t.numel() * t.element_size(), 0))
            self._registered.append(t)
        return t

    def release_pinned(self) -> None:
        """Unregister the page-locked host memory (before the tensors are freed)."""
        if self.cuda:
            for t in self._registered:
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self._registered = []
