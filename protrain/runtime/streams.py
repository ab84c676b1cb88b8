"""The runtime's queues: compute, upload (H2D) and offload (D2H); pinned host memory; the
device binding of helper threads.

The cost model assumes one FIFO per copy direction next to compute: chunk uploads and swap
prefetches share the upload queue in issue order, gradients and swap-outs share the offload
queue. On CUDA these are two side streams synchronised with events; on CPU (tests) there are
no streams: every copy is synchronous and every event is None, so the same code paths run.

Every CUDA call of the runtime that is not a kernel launch lives here (and in the storage
backends), so the device-specific part can be read - and emulated on CPU by
tests/deferred_streams.py - as a whole.
"""
from __future__ import annotations

import ctypes
import functools
import threading
from contextlib import nullcontext

import torch

from .host_limits import check_pinning, pinning_failed


class Streams:
    def __init__(self, device: torch.device):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.cuda = device.type == "cuda"
        self.asynchronous = self.cuda
        """Copies may still be in flight when ``copy`` returns (host work can then overlap)."""
        self._registered: list[torch.Tensor] = []
        self._thread = threading.local()
        if self.cuda:
            self.upload = torch.cuda.Stream(device)
            self.offload = torch.cuda.Stream(device)

    # ---- helper threads -------------------------------------------------------------------
    def bind_thread(self) -> None:
        """Select this runtime's device in the calling thread. A new thread starts on device 0:
        without this, on a multi-GPU node every rank's helper threads (CPU Adam, SSD I/O) would
        create a CUDA context on GPU 0 and queue their copies there. Helper threads call it
        first (``HostWorker``, the storage backends' pool initializers)."""
        if self.cuda:
            torch.cuda.set_device(self.device)

    def copy_in_thread(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy between device memory and pinned host memory from a helper thread and wait for
        it, on that thread's own stream: the compute stream is neither used nor waited for
        (the legacy default stream would serialise with every kernel of the step)."""
        if not self.cuda:
            dst.copy_(src)
            return
        stream = getattr(self._thread, "stream", None)
        if stream is None:
            stream = self._thread.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        done = self._event()
        done.record(stream)
        done.synchronize()           # not stream.synchronize(): that one spins on a core

    # ---- host reads and writes of device data -----------------------------------------------
    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s value on the host, for a decision the host makes (the step's verdict): the
        one way the runtime reads device data, and a host-device synchronisation - the calling
        thread waits for everything its current stream has queued so far, then the compute
        stream runs dry until the host queues more. Count the calls, not the bytes. On CPU:
        ``t`` itself."""
        if not self.cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = self._event()
        done.record(torch.cuda.current_stream(self.device))
        done.synchronize()
        return host

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the device, without waiting for anything: staged in pinned
        memory and copied on the current stream (a plain ``.to(device)`` of pageable memory
        synchronises the stream first). On CPU: ``t`` itself."""
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    # ---- queues ---------------------------------------------------------------------------
    def _event(self):
        """Every CUDA event of the runtime. Blocking: a host thread that waits for one sleeps
        until the device signals it instead of spinning on a core (up to nine threads wait on
        events - CPU Adam's worker, the SSD pools' - on the cores CPU Adam needs)."""
        return torch.cuda.Event(blocking=True)

    def compute_event(self):
        """An event marking everything queued on the compute stream so far."""
        if not self.cuda:
            return None
        ev = self._event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def compute_wrote(self, *tensors):
        """``compute_event`` after compute work that wrote ``tensors`` where no version counter
        sees it (a native kernel's raw pointers: Adam), named for checkers of the waits
        (tests/deferred_streams.py); side work reading them must wait for this event."""
        return self.compute_event()

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
            done = self._event()
            done.record(stream)
        return done

    def record_on(self, queue: str):
        """An event at the current end of a side queue (None on CPU)."""
        if not self.cuda:
            return None
        ev = self._event()
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

    # ---- pinned host memory -----------------------------------------------------------------
    def pinned(self, numel: int, dtype: torch.dtype, what: str = "a host buffer") -> torch.Tensor:
        """Host memory for copies: page-locked on CUDA, plain on CPU. Registered with
        cudaHostRegister rather than taken from torch's pinned caching allocator, which rounds
        every block up to a power of two and keeps it after it is freed (up to 2x the host
        memory the plan counted, for the whole run). Give it back with ``unpin`` or
        ``release_pinned``. Refused with a ``PinnedMemoryError`` naming ``what`` where the
        host cannot give it now (``host_limits.check_pinning``), and where the allocator or
        the driver fails: pinned pages cannot be reclaimed, so an allocation past the limit
        would end in the OOM killer, not an error."""
        nbytes = numel * dtype.itemsize
        check_pinning(nbytes, what)
        try:
            t = torch.empty(numel, dtype=dtype)
            if numel and self._register(t):
                self._registered.append(t)
        except RuntimeError as e:      # the allocator's, or cudaHostRegister's (a CudaError)
            raise pinning_failed(nbytes, what, e) from e
        return t

    def unpin(self, t: torch.Tensor) -> None:
        """Give back one region from ``pinned`` (no queued copy may use it any more)."""
        for i, r in enumerate(self._registered):
            if r is t:
                self._unregister(t)           # first: a refused one stays registered
                del self._registered[i]
                return

    def release_pinned(self) -> None:
        """Give back every region from ``pinned``, once the copies still queued (which may read
        or write them) are done."""
        self.synchronize()
        for t in self._registered:
            self._unregister(t)
        self._registered = []

    def pinned_bytes(self) -> int:
        """Host bytes registered by ``pinned`` and not yet given back."""
        return sum(t.numel() * t.element_size() for t in self._registered)

    def _register(self, t: torch.Tensor) -> bool:
        if not self.cuda:
            return False
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if err != cudart.cudaError.success:
            # The failure is also left as this thread's last CUDA error, which the check after
            # the next kernel launch (cudaGetLastError) would report as that kernel's own.
            _clear_last_cuda_error()
        torch.cuda.check_error(err)
        return True

    def _unregister(self, t: torch.Tensor) -> None:
        if self.cuda:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def _clear_last_cuda_error() -> None:
    """Reset the calling thread's last CUDA runtime error (cudaGetLastError). torch's
    ``cudart()`` does not bind it (2.11): called in the libcudart torch loaded, whose state it
    is, found among the process's mappings."""
    fn = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if fn is None and _loaded_cudart() is not None:
        fn = _loaded_cudart().cudaGetLastError
    if fn is not None:
        fn()


@functools.cache
def _loaded_cudart():
    """ctypes handle of the libcudart.so this process has loaded (None: none, e.g. linked
    statically into torch)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "/libcudart.so" in path:
                    return ctypes.CDLL(path)
    except OSError:
        pass
    return None
