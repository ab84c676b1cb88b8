"""Gradients and Adam on chunks: where each gradient goes, and when each chunk is updated.

- A persistent chunk's gradients are added into its fp32 gradient buffer on the device and
  updated there by the device Adam after backward.
- An offloaded chunk's gradients are written into its device buffer over the parameters
  (backward no longer needs them once their gradient exists), copied to the host when the
  chunk's backward is done, and updated by CPU Adam as soon as they land, overlapping the
  rest of backward - the lowest pending chunk first (``_update_lowest``): the one the next
  forward uploads first, so what backward's gradients outran runs on into that forward in its
  upload order, each chunk's upload waiting for its own update. When the step needs something global first (the gradient norm for
  clipping, the overflow check for fp16 loss scaling) the update is *speculative*: it assumes
  no clipping and no overflow, keeps a copy of the chunk's master, exp_avg and exp_avg_sq from
  just before, and leaves the gradients untouched; ``step`` then commits it, or restores the
  copy and redoes the update with the clipped gradients (or skips it on overflow). Either way
  the result is the one a non-speculative step computes, bit for bit.
- ``step`` does not wait for the host updates it leaves (those not done during backward):
  they run on into the next forward, in chunk order, and each offloaded chunk's upload waits
  for its own update (``wait_host_ready``), so no stale value is ever used. Persistent chunks
  come first in execution order, so the next forward starts on them (an evaluation forward
  too). Everything else that reads host states waits for all of them first (``sync``:
  checkpoint export and import, the module's state_dict and so DeepSpeed's save_16bit_model,
  zero_grad with gradients pending, a re-plan, close). At interpreter exit the worker
  finishes them and stops before finalization (``HostWorker``). tests/test_sync_points.py
  holds the updates past each of these points.
- With gradient accumulation, each micro-batch's gradients are added into an fp32 host
  accumulator; Adam runs on the accumulation boundary.
- Adam steps every parameter at every step, on a zero gradient where none arrived (a branch
  not taken, an expert no token reached), as DeepSpeed ZeRO-0 does on one rank and on many
  (its boundary all-reduce fills a missing gradient with zeros): ``_update``, ``_zero_absent_grads``.

Where the optimizer is in its step is one state (``StepState``), moved by events: the
runtime's (``pre_forward``, ``on_grad``, ``chunk_backward_done``, ``step``, ``zero_grad``) and
those an adapter signals (``discard_gradients`` for a backward dropped after an out-of-memory
error or a checkpoint loaded, ``carry_gradients`` for gradients carried into a new plan).

Gradient clipping reproduces DeepSpeed's ``clip_grad_norm_`` exactly (per-parameter norms in
module order, stacked, combined, ``max_norm / (norm + 1e-6)`` capped at 1), so fp32 runs match
DeepSpeed bit for bit. fp16 uses DeepSpeed's own dynamic loss scaler.

Host reads of device data wait for everything queued before them (on a GPU the device then
idles until the host queues more), so there is one per step: the overflow flag and the global
norm together (``_verdict``, through ``Streams.to_host``). An offloaded chunk's part of them is
taken on the device as its gradients leave and copied to pinned host memory on the offload
queue just before them (``_device_check``): the worker reads it once the gradients are on the
host, without a synchronisation of its own.
"""
from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum, auto
from typing import Callable

import torch
from torch import nn

from .adam import SIMD_ELEMENTS, update_as_per_tensor
from .chunks import Chunk, ChunkManager
from .nvme_states import Outcome
from .options import OptimizerSetup
from .streams import Streams

log = logging.getLogger("protrain")


class HostWorker:
    """Runs host-side work (gradient accumulation, CPU Adam) in order, on a thread when a GPU
    keeps computing meanwhile, inline on CPU-only machines.

    After a task fails the remaining ones are skipped (their inputs may be inconsistent) and
    the error is raised by the next ``drain``; ``on_error`` callbacks wake whoever waits for
    something only a skipped task would have given back.

    The thread is a daemon (a script need not close anything), so at interpreter exit an
    atexit hook (``_close_all``) lets it finish the work queued (the last step's updates: an
    exit hook that runs later may still save them) and stops it. Left running, a daemon
    thread that is inside a native call without the GIL (CPU Adam, a torch op) when
    finalization starts is killed on its way back to the GIL, through C++ frames: the
    process aborts ("terminate called without an active exception")."""

    _live: set["HostWorker"] = set()
    """Threaded workers not closed yet (their threads reference them anyway)."""
    _exit_hook = False

    def __init__(self, threaded: bool, bind: Callable[[], None] | None = None,
                 side_bind: Callable[[], None] | None = None):
        """``bind``: the thread's setup (device, OpenMP threads); ``side_bind``: the side
        lane's (default ``bind``)."""
        self.threaded = threaded
        self._error: BaseException | None = None
        self._on_error: list[Callable[[], None]] = []
        if threaded:
            self._q: queue.Queue = queue.Queue()
            self._t = threading.Thread(target=self._run, args=(bind, self._q), name="protrain-host",
                                       daemon=True)
            self._t.start()
            # The side lane (``submit(side=True)``): short tasks that must not queue behind a
            # chunk's CPU Adam update - the accumulation that frees a staging buffer backward
            # is waiting for. Its own thread, in order among its tasks.
            self._side_q: queue.Queue = queue.Queue()
            self._side_t = threading.Thread(target=self._run, args=(side_bind or bind, self._side_q),
                                            name="protrain-host-acc", daemon=True)
            self._side_t.start()
            HostWorker._live.add(self)
            if not HostWorker._exit_hook:
                _register_exit_hook(HostWorker._close_all)
                HostWorker._exit_hook = True

    @property
    def failed(self) -> bool:
        return self._error is not None

    def on_error(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (on the worker thread) when a task fails."""
        self._on_error.append(fn)

    def _fail(self, e: BaseException) -> None:
        self._error = e
        for fn in self._on_error:
            fn()

    def _run(self, bind, q: queue.Queue) -> None:
        if bind is not None:
            try:
                bind()                # this thread's device calls go to the runtime's device
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread in drain()
                self._fail(e)
        while True:
            fn = q.get()
            try:
                if fn is not None and self._error is None:
                    fn()
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread in drain()
                self._fail(e)
            finally:
                q.task_done()
            if fn is None:
                return

    def submit(self, fn: Callable[[], None], side: bool = False) -> None:
        """Queue ``fn`` on the worker (in order), or with ``side`` on the side lane (in order
        among side tasks, beside the worker's: a side task that needs one of the worker's
        results waits for it itself, and the other way round)."""
        if self.threaded:
            (self._side_q if side else self._q).put(fn)
        else:
            fn()

    def wait_for(self, event: threading.Event) -> None:
        """On a worker thread: wait for ``event``, set by a task of the other lane (or raise
        when a task failed: the one that would set it may have been skipped)."""
        while not event.wait(0.05):
            if self._error is not None:
                raise RuntimeError("protrain: host-side work failed on the other lane")

    def drain_side(self) -> None:
        """Wait for the side lane's tasks (the accumulations), not the worker's."""
        if self.threaded:
            self._side_q.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("protrain: host-side optimizer work failed") from err

    def drain(self) -> None:
        if self.threaded:
            self._side_q.join()
            self._q.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("protrain: host-side optimizer work failed") from err

    def close(self, timeout: float | None = 10) -> None:
        """Stop the thread after the work queued so far (waiting up to ``timeout`` seconds);
        work submitted after it has stopped runs inline."""
        if self.threaded:
            self._side_q.put(None)
            self._q.put(None)
            self._side_t.join(timeout)
            self._t.join(timeout)
            if not self._t.is_alive() and not self._side_t.is_alive():
                self.threaded = False
                HostWorker._live.discard(self)

    @staticmethod
    def _close_all() -> None:
        """atexit: every worker finishes its queued work and stops, before finalization (atexit
        hooks run while daemon threads still may; after them they may not)."""
        for w in list(HostWorker._live):
            w.close(timeout=None)


def _register_exit_hook(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit before the thread pools shut down: queued updates of
    chunks with states on NVMe submit reads and write-backs to the stores' pools, which
    concurrent.futures stops in its own threading exit hook - before any ``atexit`` function,
    where they would fail ("cannot schedule new futures after shutdown"). Threading's exit
    hooks run in reverse order of registration, so this one (registered after
    concurrent.futures.thread is imported, which registers its own) runs first."""
    import concurrent.futures.thread  # noqa: F401 - its exit hook registered before ours
    try:
        threading._register_atexit(fn)     # private, but what concurrent.futures itself uses
    except (AttributeError, RuntimeError):  # another Python / already shutting down
        import atexit
        atexit.register(fn)


class GradientNotHeld(RuntimeError):
    """A parameter's unreduced gradient is asked for where the runtime keeps none
    (``ChunkOptimizer.local_gradient``); the message says why."""


class StepState(Enum):
    """Where the chunk optimizer is in its optimizer step (FSDP2's ``TrainingState``, for the
    step): which gradients it holds decides what an event may do - whether a backward can be
    dropped and redone exactly, which gradients a re-plan carries, whether ``step`` moves
    anything. Transitions: a gradient arrives (``on_grad``): IDLE -> BACKWARD; a forward
    begins (``pre_forward``): BACKWARD -> ACCUMULATED; ``step``, ``zero_grad`` and
    ``discard_gradients``: -> IDLE; ``carry_gradients``: -> ACCUMULATED."""

    IDLE = auto()
    """No gradient since the last step, zero_grad or plan."""
    BACKWARD = auto()
    """The micro-batch in progress has sent gradients; none of an earlier one is held."""
    ACCUMULATED = auto()
    """Gradients of an earlier micro-batch of this step are held (a forward began after them,
    or a re-plan carried them over)."""


class ChunkOptimizer:
    def __init__(self, chunks: ChunkManager, streams: Streams, setup: OptimizerSetup, *,
                 host_kernel, device_kernel, params_in_order: list[nn.Parameter],
                 pause_accounting=None):
        self.chunks = chunks
        self.streams = streams
        self.param_groups = setup.param_groups
        self.hyper = setup.hyper
        self.host_kernel = host_kernel
        self.device_kernel = device_kernel
        self.gas = setup.grad_accumulation_steps
        self.clip = setup.clip
        self.loss_scaler = setup.loss_scaler
        self.params_in_order = params_in_order
        host_thread = setup.host_thread
        self.worker = HostWorker(threaded=streams.asynchronous if host_thread is None else host_thread,
                                 bind=lambda: _bind_worker(streams, host_kernel),
                                 side_bind=lambda: _bind_worker(streams, host_kernel, share=0.25))
        self._pause = pause_accounting or (lambda: _nullcontext())
        self.overlap = True
        # Updates during backward are exact only when no global quantity scales them; else
        # they speculate (see the module docstring) on the chunks the plan chose.
        self.speculative = self.clip > 0 or self.loss_scaler is not None
        offloaded = sorted(self.chunks.offloaded(), key=lambda c: c.index)
        speculate = setup.speculate_chunks
        n_speculative = len(offloaded) if speculate is None else max(0, min(speculate, len(offloaded)))
        # The last chunks in execution order finish backward first: most time to hide behind.
        self.speculative_chunks = ({c.index for c in offloaded[len(offloaded) - n_speculative:]}
                                   if self.speculative else set())
        self.nvme = chunks.nvme
        """Where the states of the chunks on NVMe are (nvme_states.py), or None."""
        self._backup = {c.index: tuple(torch.empty(c.shard_size, dtype=torch.float32) for _ in range(3))
                        for c in offloaded if c.index in self.speculative_chunks
                        and not chunks.on_nvme(c)}
        """Per speculating chunk in host memory, where master, exp_avg and exp_avg_sq are kept
        before its speculative update (allocated once: 12 bytes per parameter of the chunk's
        shard). A chunk on NVMe needs none: its speculative update goes to the other of its
        two places on the drive (NvmeStates)."""
        self._speculations: dict[int, _Speculation] = {}
        """This step's speculative updates, by chunk index (written by the worker)."""
        self._ready = {c.index: threading.Event() for c in offloaded}
        """Set while the offloaded chunk's host states are final (no update queued or running)."""
        for e in self._ready.values():
            e.set()
        # A failed worker skips the tasks that would set them: wake the waiters to raise.
        self.worker.on_error(lambda: [e.set() for e in self._ready.values()])
        if self.nvme is not None:
            self.worker.on_error(self.nvme.fail)
        self.chunks.host_ready = self.wait_host_ready
        self.chunks.host_ready_now = self.host_ready_now
        self.chunks.host_sync = self.sync
        self.tracer = None               # runtime/timeline_recorder.py's, when a trace is on
        self.carry_over = True
        """Let step() return before the host updates it leaves are done (see the module doc)."""
        self.speculation_on = True
        """Whether this step speculates: not after a step that clipped or overflowed (its
        successor likely does too, and a rollback costs the backup and a second update)."""
        self.stats = OverlapStats()
        self._waited_s = 0.0
        self.boundary_backward_done = False
        """A backward at an accumulation boundary finished and ``step`` has not run since: its
        offloaded gradients went to the host as the step's (not added to an accumulator) and
        their updates may have begun, so another backward before ``step`` is refused."""
        self.first_step_of_plan = True
        """No step of this plan has been applied yet: chunk updates wait for ``step`` (none
        runs during backward), so an out-of-memory error in its backward can be redone exactly
        and a gradient arriving late (a parameter used outside its profiled part) is found
        before any update of its chunk. Cleared by the first step that applies its update."""
        self.step_state = StepState.IDLE
        # Staging for accumulation: gradients land here, then are added on the host.
        self._staging: list[torch.Tensor] = []
        self._staging_free: list[int] = []
        if self.gas > 1 and self.chunks.offloaded():
            cap = max(c.shard_size for c in self.chunks.offloaded())
            self._staging = self._pinned_or_stop(lambda: [streams.pinned(cap, self.chunks.dtype)
                                                          for _ in range(2)])
            self._staging_free = [0, 1]
            self._staging_lock = threading.Condition()
            self.worker.on_error(self._wake_staging)
        self._queued: set[int] = set()
        """Offloaded chunks whose CPU Adam update of this step was submitted (main thread's
        view: the worker may still be running it)."""
        self._pool = _Pool([self.chunks.on_nvme(c) for c in offloaded])
        self._pooled: set[int] = set()
        """Chunks whose update of this step went through ``_pool`` (main thread's view)."""
        self._left: set[int] = set()
        """Offloaded chunks whose gradients of this micro-batch have left the device. One made
        resident again in the same backward (its part entered again) holds parameters, not
        gradients: its gradients go to the host and its buffer is not offloaded a second time
        (that copy would put parameters over the gradients)."""
        self._late: set[int] = set()
        """Offloaded chunks that received a gradient after their backward was declared done
        (a parameter used outside the part it was profiled in): updated in ``step`` only,
        once every gradient exists."""
        self._reductions: dict[int, object] = {}
        """Persistent chunks whose gradient all-reduce of this step is in flight (several ranks,
        started as the chunk's backward ended: ``persistent_backward_done``), by index: their
        handles, waited for in ``step``. Nothing may touch such a chunk's gradients before."""
        self._persistent_done: set[int] = set()
        """Persistent chunks whose backward of this boundary micro-batch is over."""
        self._late_persistent: set[int] = set()
        """Persistent chunks that received a gradient after their backward was over in the
        first step of the plan (a parameter used outside its profiled part), agreed over the
        ranks: all-reduced in ``step``, never early."""
        self.overflow = False
        self.global_grad_norm: float | None = None
        self._checks: dict[int, _ChunkCheck] = {}
        """This step's verdict inputs of offloaded chunks, taken on the device as their
        gradients left (``_device_check``) or on the host as they landed (``_host_check``); a
        chunk without one is checked in step()."""
        self._verdict_room = self._pinned_or_stop(lambda: self._verdict_regions(offloaded))
        """Per offloaded chunk, pinned host memory its device check is copied into."""
        self._param_index = {p: i for i, p in enumerate(params_in_order)}
        self._offsets = {c.index: [s.offset for s in c.slots] for c in self.chunks.chunks}
        self._fresh: set[int] = set()
        """Offloaded chunks whose gradient region holds this optimizer step's gradients (copied
        from the device, or added there by a late gradient). Main thread only. Every other
        offloaded chunk is zeroed at the step (``_zero_absent_grads``): its region still holds
        an earlier step's gradients (without accumulation an update leaves them there, since
        the next copy overwrites the region whole: a pass over 4 bytes per parameter saved) or,
        in 16-bit training without accumulation, the parameters themselves."""

    # ---- lifecycle events (the runtime's and the adapters') ---------------------------------
    def pre_forward(self) -> None:
        """A forward begins: gradients held now are an earlier micro-batch's."""
        if self.step_state is StepState.BACKWARD:
            self.step_state = StepState.ACCUMULATED
        self._left.clear()

    def holds_accumulated_gradients(self) -> bool:
        """Whether gradients of earlier micro-batches of this step are held to be added to
        (gradient accumulation): what a re-plan before or during a forward carries into the
        new plan. Without accumulation a step's gradients are one micro-batch's: a re-plan
        drops them and the micro-batch is redone."""
        return self.gas > 1 and self.step_state is not StepState.IDLE

    def can_redo_micro_batch(self) -> bool:
        """Whether this micro-batch's backward can be dropped and run again exactly: no chunk
        update of the step has been submitted (the worker may be running one: that is as good
        as applied), and no gradient of an earlier micro-batch is mixed with this one's."""
        return not self._queued and not (self.gas > 1 and self.step_state is StepState.ACCUMULATED)

    def discard_gradients(self) -> None:
        """A backward dropped (out of memory) or states loaded in its place (a checkpoint):
        every gradient of this step is cleared, whether or not one was seen to arrive."""
        self.boundary_backward_done = False
        self.worker.drain()
        self.step_state = StepState.BACKWARD
        self._reset()

    def carry_gradients(self) -> None:
        """Gradients of earlier micro-batches of this step were put into the chunks (a re-plan
        within the step): the step goes on accumulating onto them."""
        self.step_state = StepState.ACCUMULATED

    def scale_gradients(self, ratio: float) -> None:
        """Multiply every gradient accumulated since the last optimizer step by ``ratio``
        (before anything of the step is applied: ``first_step_of_plan``)."""
        self.worker.drain()
        for c in self.chunks.chunks:
            if c.persistent:
                c.grad.mul_(ratio)
            else:
                self.streams.host_wait(c.grads_on_host)
                self._host_grads(c).mul_(ratio)

    # ---- backward ------------------------------------------------------------------------
    def on_grad(self, p: nn.Parameter) -> None:
        """post_accumulate_grad hook: move the gradient into its chunk."""
        g = p.grad
        if g is None:
            return
        if self.boundary_backward_done:
            raise RuntimeError(
                "a second backward before engine.step() at a gradient accumulation boundary (with "
                "\"gradient_accumulation_steps\": 1 and no engine.no_sync(), every backward is one): "
                "ProTrain moves a boundary's gradients off the device as the step's and may start "
                "their update at once, so it cannot add more to them. Run the micro-batches before "
                "the last one under engine.no_sync() (or set_gradient_accumulation_boundary(False)), "
                "or set \"gradient_accumulation_steps\" in the JSON to the micro-batches per step "
                "and call engine.backward(loss); engine.step() for each, as DeepSpeed's docs do")
        c, s = self.chunks.slot_of[p]
        if c.persistent and c.index in self._persistent_done:
            self._late_persistent_gradient(c, s)
        with torch.no_grad():
            if c.persistent:
                c.grad[s.offset:s.stop].add_(g.reshape(-1))
            elif c.buffer is not None and c.state.value == "resident" and c.index not in self._left:
                self.chunks.pool.tensors[c.buffer][s.offset:s.stop].copy_(g.reshape(-1))
            elif self.chunks.dp.world > 1:
                raise RuntimeError(
                    f"gradient of {s.name} arrived after its chunk was reduce-scattered: the model "
                    f"uses it outside the part it was profiled in, which data-parallel sharding "
                    f"cannot repair; re-profile (delete the plan file) or report the model")
            else:
                # The chunk's backward was declared done before this gradient arrived (a
                # parameter used outside its part). Correct, but slow: add it on the host, and
                # update this chunk only in step() from now on.
                if c.index in self._queued:
                    raise RuntimeError(
                        f"gradient of {s.name} arrived after CPU Adam already updated its chunk "
                        f"{c.index} in this step: the model uses it outside the part it was "
                        f"profiled in, and started doing so after the first step of the plan, so "
                        f"this step cannot be applied exactly. Resume from the last checkpoint (the "
                        f"first step after a plan finds such parameters and defers their chunk's "
                        f"update to the end of backward)")
                if c.index not in self._late:
                    log.warning("protrain: gradient of %s arrived after its chunk left the device; "
                                "handled on the host (slow), chunk %d updated after backward. The "
                                "model uses it outside the part it was profiled in.", s.name, c.index)
                    self._late.add(c.index)
                self.worker.drain()
                self.streams.host_wait(c.grads_on_host)
                target = self._host_grads(c)
                if c.index not in self._fresh:
                    # An earlier step's gradients or the parameters (no copy this step yet):
                    # zeroed first; from now on the region is this step's.
                    target.zero_()
                    self._fresh.add(c.index)
                target[s.offset:s.stop].add_(g.reshape(-1).to(target.device, target.dtype))
                self._checks.pop(c.index, None)       # taken before this gradient: redone in step
        s.has_grad = True
        if self.step_state is StepState.IDLE:
            self.step_state = StepState.BACKWARD
        p.grad = None

    def _late_persistent_gradient(self, c: Chunk, s) -> None:
        """A gradient for persistent chunk ``c`` after its backward was declared over (its
        parameter is used outside the part it was profiled in): learnt in the plan's first
        step, whose reductions all wait for ``step``; refused once the chunk's sum is on its
        way over the ranks (adding to it would race the collective, and a second one for
        this rank alone would pair with nothing)."""
        if self.first_step_of_plan:
            self._late_persistent.add(c.index)
        elif c.index in self._reductions:
            raise RuntimeError(
                f"gradient of {s.name} arrived after its persistent chunk {c.index} began its "
                f"all-reduce over the {self.chunks.dp.world} ranks: the model uses it outside the "
                f"part it was profiled in, and started doing so after the first step of the plan, "
                f"so this step cannot be applied exactly. Resume from the last checkpoint (the "
                f"first step of a plan finds such parameters and reduces their chunk in step())")

    def persistent_backward_done(self, c: Chunk, boundary: bool) -> None:
        """Every gradient of persistent chunk ``c`` for this micro-batch exists. At the
        accumulation boundary on several ranks its sum over the ranks starts now, under the
        rest of the backward (fp32, the sum DeepSpeed ZeRO-0 all-reduces), and ``step`` waits
        for it; not in the plan's first step (late gradients are being learnt), nor for a
        chunk that receives them."""
        if not boundary or self.chunks.dp.world == 1 or c.index in self._persistent_done:
            return
        self._persistent_done.add(c.index)
        if self.first_step_of_plan or c.index in self._late_persistent:
            return
        work = self.chunks.dp.all_reduce_start(c.grad)
        if work is not None:
            self._reductions[c.index] = work
            self.stats.reductions_overlapped += 1

    def wait_collectives(self) -> None:
        """Every persistent chunk's all-reduce in flight has finished (before its gradients
        are zeroed or its memory given back); a chunk waited for so is summed again in no
        ``step`` - this is only called where the step's gradients are dropped."""
        while self._reductions:
            self._reductions.pop(next(iter(self._reductions))).wait()

    def _agree_on_late_persistent(self) -> None:
        """The plan's first step: the persistent chunks that received late gradients on any
        rank are reduced in ``step`` on every rank (the ranks must start the same collectives
        in the same order)."""
        persistent = [c for c in self.chunks.chunks if c.persistent]
        if not persistent or self.chunks.dp.world == 1:
            return
        flags = torch.zeros(len(self.chunks.chunks), dtype=torch.int32, device=persistent[0].grad.device)
        for i in self._late_persistent:
            flags[i] = 1
        self.chunks.dp.all_reduce_(flags, op=torch.distributed.ReduceOp.MAX)
        self._late_persistent = {i for i, f in enumerate(flags.tolist()) if f}

    def _host_grads(self, c: Chunk) -> torch.Tensor:
        """Where an offloaded chunk's gradients land on the host: its fp32 accumulator, else
        (16-bit training without accumulation) the host copy of its parameters, the upload's
        source, which the update rewrites from the master once it has read them."""
        return c.grad_acc if c.grad_acc is not None else c.shadow

    def chunk_backward_done(self, c: Chunk, boundary: bool) -> None:
        """All gradients of ``c`` for this micro-batch exist."""
        if c.persistent or c.state.value != "resident":
            return
        if c.index in self._left:
            self.chunks.evict(c)            # parameters only: this micro-batch's gradients are out
            return
        self._left.add(c.index)
        if c.sharded:
            # Its shard's gradients stay on the device (summed into the accumulator over the
            # micro-batches); device Adam updates it at the step, with the persistent chunks.
            self._fresh.add(c.index)
            self.chunks.offload_grads(c, self._host_grads(c), accumulate=self.gas > 1)
            return
        verdict = (boundary and not self.first_step_of_plan and c.index not in self._late
                   and (self.clip > 0 or self.loss_scaler is not None))
        self._fresh.add(c.index)                  # the copy below lands this step's gradients
        if self.gas == 1:
            # The chunk's part of the step's verdict (norms, overflow) taken on the device,
            # where the gradients are, as DeepSpeed does for offloaded gradients.
            self.chunks.offload_grads(c, self._host_grads(c), check=self._device_check if verdict else None)
        accumulated = None
        if self.gas > 1:
            # The accumulation frees the staging buffer backward may be waiting for: on the
            # side lane, never behind a chunk's CPU Adam update on the worker (with two buffers
            # and one in-order thread, backward waited for CPU Adam from the 4th chunk of the
            # boundary micro-step on). The worker's tasks for this chunk below wait for it.
            slot = self._take_staging()
            self.chunks.offload_grads(c, self._staging[slot][:c.shard_size])
            accumulated = threading.Event()
            self.worker.submit(lambda c=c, slot=slot, done=accumulated: self._accumulate(c, slot, done),
                               side=True)
        if not boundary or self.first_step_of_plan or c.index in self._queued or c.index in self._late:
            return
        if not self.speculative and self.gas == 1:
            self._queued.add(c.index)
            # States on the drive: their read starts now, in the order the pool takes them.
            self._in_forward_order(c, accumulated, self._want(c))
        elif not self.speculative:
            # With accumulation, as gradients land; states on the drive in the order their
            # reads are started (the staging ring's).
            self._queued.add(c.index)
            use = self._want(c)
            self._submit_after(accumulated, lambda c=c, use=use: self._host_update(c, None, None, "adam", use))
        elif c.index in self.speculative_chunks and self.speculation_on:
            self._queued.add(c.index)
            inv_scale = self._inv_scale()
            use = self._want(c)
            self._submit_after(accumulated, lambda c=c, use=use: self._speculate(c, inv_scale, use))
        elif self.gas > 1:
            # Accumulated gradients: their part of the verdict is taken on the host, by the
            # worker after this micro-step's accumulation, while backward goes on.
            self._submit_after(accumulated, lambda c=c: self._check(c))

    def _in_forward_order(self, c: Chunk, accumulated: threading.Event | None, use=None) -> None:
        """Submit ``c``'s exact update to the pool the worker takes from (``_Pool``; ``use``:
        its states' read from the drive, started); its upload waits for it (``_ready``) from
        now, not from ``step``."""
        self._ready[c.index].clear()
        self._pooled.add(c.index)
        self._pool.add(c.index, accumulated, use)
        self.worker.submit(self._update_lowest)

    def _update_lowest(self) -> None:
        """Worker: the exact update of the chunk the pool gives (``_Pool.take``: the lowest in
        host memory, or the next on the drive), then its accumulator cleared and its upload let
        go. Gradients land in descending chunk order, so in backward this is the latest, and
        what backward leaves runs in the next forward's upload order: that forward waits for
        its first offloaded chunk's update, not for the whole backlog (issue 37). One task per
        pooled chunk."""
        i, accumulated, use = self._pool.take()
        c = self.chunks.chunks[i]
        try:
            if accumulated is not None:
                self.worker.wait_for(accumulated)
            self._host_update(c, None, None, "adam", use)
            if self.gas > 1 and c.grad_acc is not None:
                c.grad_acc.zero_()          # the next step's accumulation starts from zero
        finally:
            self._ready[i].set()

    def _submit_after(self, accumulated: threading.Event | None, fn: Callable[[], None]) -> None:
        """Queue ``fn`` on the worker, to run once ``accumulated`` (the side lane's
        accumulation of the gradients it reads; None: none) is set."""
        if accumulated is None:
            self.worker.submit(fn)
        else:
            self.worker.submit(lambda: (self.worker.wait_for(accumulated), fn()))

    def _take_staging(self) -> int:
        with self._staging_lock:
            while not self._staging_free and not self.worker.failed:
                self._staging_lock.wait()
            if self._staging_free:
                return self._staging_free.pop(0)
        # The worker failed: the task that would have given a buffer back was skipped.
        self.worker.drain()
        raise RuntimeError("protrain: host-side optimizer work failed")

    def _wake_staging(self) -> None:
        with self._staging_lock:
            self._staging_lock.notify_all()

    def _accumulate(self, c: Chunk, slot: int, done: threading.Event) -> None:
        """Side lane: add a micro-batch's gradients of ``c`` (landed in a staging buffer) to
        its accumulator, after the worker is done with the last step's (its update reads and
        then zeroes them: ``_ready``, which the chunk's upload for this forward waited for
        already, unless no forward used it)."""
        try:
            ready = self._ready.get(c.index)
            if ready is not None:
                self.worker.wait_for(ready)
            self.streams.host_wait(c.grads_on_host)
            c.grad_acc.add_(self._staging[slot][:c.shard_size])
            with self._staging_lock:
                self._staging_free.append(slot)
                self._staging_lock.notify()
        finally:
            done.set()

    # ---- step ------------------------------------------------------------------------------
    def _inv_scale(self) -> float:
        return 1.0 / self.loss_scaler.cur_scale if self.loss_scaler is not None else 1.0

    def step(self) -> None:
        """The accumulation boundary's update. Sets ``overflow`` and ``global_grad_norm``."""
        t0 = time.perf_counter()
        self.boundary_backward_done = False
        # Exact updates (no verdict to wait for) run on past step() into the next forward.
        # (not yet with accumulation: its side lane's ordering with the carried updates is
        # unproven, so step() waits for them as before).
        self._wait_for_gradients(updates=self.speculative or self.gas > 1 or not self.carry_over)
        self.overflow = False
        self.global_grad_norm = None
        if self.step_state is StepState.IDLE:
            # No gradient since the last step (no backward ran): DeepSpeed's optimizer finds
            # every grad None and moves nothing; neither does this one.
            self._reset()
            return
        self._zero_absent_grads()
        inv_scale = self._inv_scale()
        # The verdict's host work (the first step of a plan checks every offloaded chunk's
        # gradients here, on the host) runs on the rank's share of the cores, as the worker's
        # does: the training thread's own count is 1 under torchrun (tens of seconds at 70B).
        from .host_threads import omp_threads
        with self._pause(), omp_threads(getattr(self.host_kernel, "threads", 0) or None):
            overflow, norm = self._judge(inv_scale)
            if overflow:
                self._skip_step()
                self.stats.exposed_s = time.perf_counter() - t0 + self._take_waited()
                return
            coef, clipped = self._coefficient(norm, inv_scale)
            t_queue = time.perf_counter()
            self._finish_offloaded(coef, clipped)
            self._trace("compute", "step", "updates queued after the verdict", t_queue)
            t0 += self._update_persistent(coef)      # device Adam is not CPU Adam's exposure
            if not self.carry_over:
                self.worker.drain()
            self.speculation_on = not clipped
        self._queued.clear()
        self._pooled.clear()
        self._left.clear()
        self._checks.clear()
        self._fresh.clear()
        self.step_state = StepState.IDLE
        self.first_step_of_plan = False
        self.stats.exposed_s = time.perf_counter() - t0 + self._take_waited()

    def _wait_for_gradients(self, updates: bool = True) -> None:
        """Every gradient of the step on the host: the worker's tasks done (accumulation,
        speculative updates; with ``updates`` False only the accumulations), every offloaded
        chunk's gradient copy landed."""
        if updates:
            self.worker.drain()
        else:
            self.worker.drain_side()
        for c in self.chunks.streamed():
            self.streams.host_wait(c.grads_on_host)

    def _judge(self, inv_scale: float) -> tuple[bool, torch.Tensor | None]:
        """The step's verdict over every rank: (overflow, global gradient norm), the loss
        scale updated on it. Persistent chunks' gradients are averaged over the ranks first
        (they are replicated)."""
        dp = self.chunks.dp
        if dp.world > 1:
            if self.first_step_of_plan:
                self._agree_on_late_persistent()
            for c in self.chunks.chunks:
                if c.persistent:
                    work = self._reductions.pop(c.index, None)
                    if work is not None:
                        work.wait()           # started as the chunk's backward ended
                    else:
                        dp.all_reduce_(c.grad)
                    c.grad.div_(dp.world)
            self._persistent_done.clear()
        overflow, norm = self._verdict(inv_scale)
        if self.loss_scaler is None:
            return False, norm
        self.overflow = overflow
        self.loss_scaler.update_scale(self.overflow)
        return overflow, norm

    def _skip_step(self) -> None:
        """fp16 overflow: nothing of the step stands - speculative updates undone, the host
        copies of the parameters the gradients landed over put back, gradients cleared."""
        log.info("protrain: fp16 overflow, step skipped; loss scale now %s", self.loss_scaler.cur_scale)
        for i in self._applied():
            self._rollback(self.chunks.chunks[i])
        self._restore_params_after_skip()
        self.speculation_on = False
        self._reset()

    def _coefficient(self, norm: torch.Tensor | None,
                     inv_scale: float) -> tuple[torch.Tensor | None, bool]:
        """(what every gradient is multiplied by in the update - clipping and loss unscaling
        together; None: 1 - and whether the step clipped). Sets ``global_grad_norm``."""
        coef = clip_coef = None
        if self.clip > 0:
            # DeepSpeed's coefficient, on the host (fp32 add, divide and min: the same bits
            # as on the device); the device Adam gets its own copy.
            self.global_grad_norm = float(norm)
            max_norm = torch.tensor([float(self.clip)])
            clip_coef = torch.min(torch.tensor([1.0]), max_norm / (norm + 1e-6))
            coef = clip_coef if inv_scale == 1.0 else clip_coef * inv_scale
        elif inv_scale != 1.0:
            coef = torch.tensor([inv_scale])
        return coef, clip_coef is not None and float(clip_coef) != 1.0

    def _finish_offloaded(self, coef: torch.Tensor | None, clipped: bool) -> None:
        """What is left of each offloaded chunk's update, decided here and done on the worker:
        first what needs no update (commits), then the updates in chunk order (the next
        forward's upload order), those of chunks on the drive interleaved in proportion
        (``interleaved``), in chunk order too."""
        left = []
        for c in sorted(self.chunks.offloaded(), key=lambda c: c.index):
            speculation = self._speculations.pop(c.index, None)
            if speculation is not None and speculation.applied:
                if not clipped and speculation.hypers == self._hypers(c, speculation.steps):
                    action = "commit"      # exactly what the update with ``coef`` computes
                    self.stats.overlapped_chunks += 1
                else:
                    action = "redo"
                    for s, step in zip(c.slots, speculation.steps):
                        s.step = step
                    self.stats.rollbacks += 1
            elif c.index in self._pooled:      # updated exactly, or being: its task lets it go
                self.stats.overlapped_chunks += 1
                for s in c.slots:
                    s.has_grad = False
                continue
            elif c.index in self._queued:
                action = None              # updated exactly during backward
                self.stats.overlapped_chunks += 1
            else:
                action = "update"
            # Hyperparameters as of now: a scheduler steps after this returns.
            segments = self._hypers(c) if action in ("redo", "update") else None
            left.append((c, action, speculation, segments))
        works = [x for x in left if x[1] in ("redo", "update")]
        order = [x for x in left if x[1] not in ("redo", "update")] + interleaved(
            [x for x in works if not self.chunks.on_nvme(x[0])], [x for x in works if self.chunks.on_nvme(x[0])])
        for c, action, speculation, segments in order:
            use = self._settle_on_drive(c, action)         # reads wanted in the worker's order
            self._ready[c.index].clear()
            self.worker.submit(lambda c=c, a=action, speculation=speculation, coef=coef, seg=segments,
                               use=use: self._finish_chunk(c, a, speculation, coef, seg, use))

    def _update_persistent(self, coef: torch.Tensor | None) -> float:
        """Device Adam on the persistent chunks, whole or sharded; returns the seconds it took."""
        t_dev = time.perf_counter()
        coef_dev = self.streams.to_device(coef) if coef is not None else None
        for c in self.chunks.chunks:
            if c.persistent:
                self._device_update(c, coef_dev)
                self._reset_chunk(c)
            elif c.sharded:
                self._update(c, self._host_grads(c), self.device_kernel, coef_dev)
                if c.shadow is not None:
                    c.shadow.copy_(c.master)      # the next gather's source: updated parameters
                self._reset_chunk(c)
                self.chunks.device_states_written(c)
        spent = time.perf_counter() - t_dev
        self._trace("compute", "device_adam", "persistent chunks", t_dev)
        return spent

    def _settle_on_drive(self, c: Chunk, action):
        """Main thread, deciding ``c``'s step (the worker is drained: every speculative
        write-back is queued): for a chunk on NVMe, make its speculative update current or drop
        it, and want its states for the worker's part (None: it needs none)."""
        if not self.chunks.on_nvme(c):
            return None
        if action == "commit":
            self.nvme.commit(c)
            # 16-bit: the upload copy follows the committed master (on the drive now).
            return self.nvme.want(c, master_only=True) if c.shadow is not None else None
        if action == "redo":
            self.nvme.discard(c)          # the redo re-reads the states from before it
        return self.nvme.want(c) if action in ("redo", "update") else None

    def _want(self, c: Chunk):
        """Before submitting a task that updates ``c``: for a chunk on NVMe, start reading its
        states in the worker's order."""
        return self.nvme.want(c) if self.chunks.on_nvme(c) else None

    @contextmanager
    def _held(self, c: Chunk, use, outcome):
        """Worker: ``c``'s states from the drive for the body (``use`` from ``_want``; None: a
        chunk in host memory), written back after it per ``outcome`` (nvme_states.Outcome,
        the name of its member); nothing is written back if the body fails."""
        if use is None:
            yield
            return
        self.nvme.hold(c, use)
        done = Outcome.UNCHANGED
        try:
            yield
            done = Outcome[outcome]
        finally:
            self.nvme.release(c, use, done)

    def _finish_chunk(self, c: Chunk, action, speculation, coef, segments, use=None) -> None:
        """Worker: the rest of an offloaded chunk's step, then its gradients cleared for the
        next one, then its upload may go."""
        try:
            with self._pause():
                if action == "commit":
                    with self._held(c, use, "UNCHANGED"):
                        self._commit(c)
                elif action == "redo":
                    t = time.perf_counter()
                    if use is None:
                        self._restore(c, speculation)
                    else:                 # the states are re-read from the drive by the redo
                        self.nvme.restore_master(c)
                    self._trace("cpu_adam", "rollback", f"chunk {c.index}", t)
                if action in ("redo", "update"):
                    self._host_update(c, coef, segments, "redo" if action == "redo" else "adam", use)
                self._reset_chunk(c)
        finally:
            self._ready[c.index].set()

    def backup_bytes(self) -> int:
        """Host bytes of the speculation backups (chunks in host memory that speculate)."""
        return sum(t.numel() * t.element_size() for b in self._backup.values() for t in b)

    def host_ready_now(self, c: Chunk) -> bool:
        """Whether ``c``'s host states are final now (no wait)."""
        e = self._ready.get(c.index)
        return e is None or e.is_set()

    def wait_host_ready(self, c: Chunk) -> None:
        """Block until ``c``'s host states are final (its upload's source)."""
        e = self._ready.get(c.index)
        if e is None or e.is_set():
            return
        t = time.perf_counter()
        e.wait()
        if self.worker.failed:
            self.worker.drain()                 # raises the worker's error
        self._waited_s += time.perf_counter() - t

    def _take_waited(self) -> float:
        """The time the training thread waited for chunks' updates (``wait_host_ready``) since
        the last step - in this step's forward and backward, for the updates the last step
        carried over - and start counting again."""
        waited, self._waited_s = self._waited_s, 0.0
        return waited

    def sync(self) -> None:
        """Wait for every pending host update (before reading or writing host states), and
        for the write-backs of the states on NVMe those updates started: the worker's task
        ends when it has queued its chunk's write, which the store finishes later - a reader
        of the state file (a test's damage, an export) must find the write landed, not
        racing it."""
        self.worker.drain()
        if self.nvme is not None:
            self.nvme.drain()

    def _reset_chunk(self, c: Chunk) -> None:
        if c.persistent:
            c.grad.zero_()
        elif c.grad_acc is not None and self.gas > 1:
            c.grad_acc.zero_()              # without accumulation: left (see _fresh)
        for s in c.slots:
            s.has_grad = False

    def _zero_absent_grads(self) -> None:
        """The offloaded chunks that got no gradient copy in this step (no parameter of theirs
        was used, or their part's backward never ran): Adam steps them all the same, on zero
        gradients, as DeepSpeed does (see ``_update``). Their gradient regions are zeroed, so
        every reader (norm, overflow test, update) sees zeros there. Every offloaded chunk's
        device copy is dropped (those that got gradients have none, unless uploaded again
        after them): a chunk still in a buffer would be reused by the next forward without
        waiting for this update (``upload`` waits for it; reuse does not)."""
        for c in self.chunks.streamed():
            self.chunks.evict(c)
            if c.index not in self._fresh:
                self.wait_host_ready(c)      # an update carried over reads its region
                self._host_grads(c).zero_()

    def _reset(self) -> None:
        self.wait_collectives()            # before their gradients are zeroed
        self._persistent_done.clear()
        self._queued.clear()
        self._pooled.clear()
        self._left.clear()
        self._speculations.clear()
        self._checks.clear()
        if self.step_state is StepState.IDLE:
            return
        self.step_state = StepState.IDLE
        self._fresh.clear()                       # zeroed below
        for c in self.chunks.chunks:
            if c.persistent:
                c.grad.zero_()
            elif c.grad_acc is not None:
                c.grad_acc.zero_()
            for s in c.slots:
                s.has_grad = False

    def zero_grad(self) -> None:
        """Gradients are cleared by ``step`` (DeepSpeed calls this right after it: nothing to
        do then, and the host updates keep running); an explicit zero_grad between micro-batches
        (not at a boundary) discards the accumulated ones, as torch's would."""
        if self.step_state is StepState.IDLE:
            return
        self.worker.drain()
        self._reset()

    def _segments(self, c: Chunk):
        """Contiguous runs of parameters (their part in this rank's shard) of one param group and
        one step count, in the coordinates of the chunk's local tensors, each one kernel call
        computing what DeepSpeed's per-tensor calls compute (``update_as_per_tensor``): a run
        goes on past a parameter only while it is whole SIMD blocks."""
        lo, hi = (0, c.numel) if c.persistent else (c.shard_lo, c.shard_hi)
        run, extensible = None, False
        for s in c.slots:
            a, b = max(s.offset, lo) - lo, min(s.stop, hi) - lo
            if a >= b:
                continue
            if extensible and run[2] == s.group and run[3] == s.step and run[1] == a:
                run[1] = b
            else:
                if run:
                    yield tuple(run)
                run = [a, b, s.group, s.step]
            extensible = (b - run[0]) % SIMD_ELEMENTS == 0 and s.numel % SIMD_ELEMENTS == 0
        if run:
            yield tuple(run)

    def _scalar_from(self, c: Chunk, lo: int, hi: int) -> int:
        """Where, in a segment [lo, hi) of ``c``'s local tensors, DeepSpeed's per-tensor call
        starts its scalar tail (the last parameter's last numel % SIMD_ELEMENTS elements; the
        segment's length when they lie beyond it)."""
        base = 0 if c.persistent else c.shard_lo
        s = c.slots[bisect.bisect_right(self._offsets[c.index], hi - 1 + base) - 1]
        tail = s.stop - s.numel % SIMD_ELEMENTS - base
        return min(max(tail, lo), hi) - lo

    def _update(self, c: Chunk, grads: torch.Tensor, kernel, coef, keep_grads: bool = False,
                backup=None, segments=None) -> None:
        """Adam on every parameter of ``c``, those without a gradient in this step on zeros
        (their regions hold zeros: ``offload_grads``, ``_zero_absent_grads``). DeepSpeed ZeRO-0 does the
        same on one rank as on several: at the boundary its all-reduce gives every parameter
        whose ``grad`` is None a zero one (engine._get_gradients_for_reduction), so its
        optimizer steps them all (moments decay, weight decay applies, the step count
        advances); Megatron's gradient buffers do too. Every parameter therefore has the same
        step count, which also keeps the CPU Adam kernel's cached beta^t independent of the
        order in which the chunks are updated (the worker's and the main thread's updates
        interleave by timing). ``backup`` (three tensors like the chunk's master): receives
        each segment's master, exp_avg and exp_avg_sq first. ``segments``: (lo, hi, step,
        hyperparameters) taken earlier (``_hypers``), else now."""
        for lo, hi, step, h in (segments if segments is not None else self._hypers(c)):
            # fp32 gradient regions are ours to scale in place (they are overwritten or zeroed
            # before the next step) unless a speculative update may have to be redone from them.
            update_as_per_tensor(kernel, c.master[lo:hi], grads[lo:hi], c.exp_avg[lo:hi],
                                 c.exp_avg_sq[lo:hi], step + 1, h,
                                 scalar_from=self._scalar_from(c, lo, hi), scale=coef,
                                 grad_writable=not keep_grads,
                                 backup=() if backup is None else [b[lo:hi] for b in backup])
        for s in c.slots:
            s.step += 1

    def _hypers(self, c: Chunk, steps: list[int] | None = None) -> list:
        """(segment, step, hyperparameters) of each update of the chunk as it would run now
        (a scheduler or the user may change the hyperparameters between backward and step);
        ``steps``: the slots' step counts to assume."""
        saved = [s.step for s in c.slots]
        if steps is not None:
            for s, n in zip(c.slots, steps):
                s.step = n
        try:
            return [(lo, hi, step, self.hyper(self.param_groups[group]))
                    for lo, hi, group, step in self._segments(c)]
        finally:
            for s, n in zip(c.slots, saved):
                s.step = n

    # ---- speculation (clipping / fp16 loss scaling) -------------------------------------------
    def _speculate(self, c: Chunk, inv_scale: float, use=None) -> None:
        """Worker: update ``c`` as if the step clips nothing and overflows nowhere, keeping
        what a rollback needs (a backup in host memory; on NVMe, the states from before in
        their place on the drive). Gradients are left as they are (step() reads them for the
        norm and the overflow check, and a redo updates from them)."""
        self.streams.host_wait(c.grads_on_host)
        with self._pause():
            grads = self._host_grads(c)
            check = self._checks.get(c.index) or self._host_check(c, grads)
            speculation = _Speculation(steps=[s.step for s in c.slots], hypers=self._hypers(c))
            self._speculations[c.index] = speculation
            if not check.finite:
                if use is not None:
                    self.nvme.release(c, use, Outcome.UNCHANGED)
                return                      # this step overflows: step() skips it
            coef = None if inv_scale == 1.0 else torch.tensor([inv_scale])
            t = time.perf_counter()
            with self._held(c, use, "SPECULATED"):
                if use is not None:
                    self.nvme.keep_master(c)      # fp32: the parameters change in place
                self._update(c, grads, self.host_kernel, coef, keep_grads=True,
                             backup=self._backup.get(c.index))
            self._trace("cpu_adam", "backup_adam", f"chunk {c.index}", t)
            speculation.applied = True

    def _check(self, c: Chunk) -> None:
        """Worker: ``c``'s part of the step's verdict, once its gradients are on the host."""
        self.streams.host_wait(c.grads_on_host)
        t = time.perf_counter()
        with self._pause():
            self._host_check(c, self._host_grads(c))
        self._trace("cpu_adam", "check", f"chunk {c.index}", t)

    def _pinned_or_stop(self, allocate):
        """``allocate()`` (pinned host memory); if the host cannot give it, the worker's threads,
        started already, are stopped before the error goes up (the runtime's build undoes the
        rest: runtime.py ``_unbuild``)."""
        try:
            return allocate()
        except BaseException:
            self.worker.close()
            raise

    def _verdict_regions(self, offloaded: list[Chunk]) -> dict[int, torch.Tensor]:
        """Pinned host room for each offloaded chunk's device check (a flag, and with clipping
        the norm of each parameter held whole in this rank's shard), in one registration."""
        if not offloaded or not (self.clip > 0 or self.loss_scaler is not None):
            return {}
        sizes = {c.index: 1 + (sum(c.shard_lo <= s.offset and s.stop <= c.shard_hi for s in c.slots)
                               if self.clip > 0 else 0) for c in offloaded}
        room = self.streams.pinned(sum(sizes.values()), torch.float32)
        regions, at = {}, 0
        for i, n in sizes.items():
            regions[i], at = room[at:at + n], at + n
        return regions

    def _take_check(self, c: Chunk, grads: torch.Tensor) -> tuple[dict[int, int], torch.Tensor]:
        """``c``'s part of the step's verdict from ``grads`` (its shard's gradients, on the
        device or the host), with no synchronisation: one fp32 vector on ``grads``' device -
        1.0 if a gradient is not finite (fp16 loss scaling; else 0.0), then with clipping the
        norm of each parameter held whole in the shard (DeepSpeed's arithmetic) - and where
        each parameter's norm is in it (module index -> position)."""
        at, terms = {}, []
        if self.clip > 0:
            for s in c.slots:       # zeros too: DeepSpeed's norm has a term for every parameter
                if c.shard_lo <= s.offset and s.stop <= c.shard_hi:
                    at[self._param_index[s.param]] = 1 + len(terms)
                    terms.append(grads[s.offset - c.shard_lo:s.stop - c.shard_lo].float().norm(2))
        if self.loss_scaler is not None:
            bad = _has_inf_or_nan(grads[:c.shard_hi - c.shard_lo]).float()
        else:
            bad = torch.zeros((), dtype=torch.float32, device=grads.device)
        return at, torch.stack([bad] + terms)

    def _device_check(self, c: Chunk, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """On the device, as ``c``'s gradients leave (``ChunkManager.offload_grads``): its check,
        and (host, device) for the offload queue to copy it just before the gradients - so the
        worker and step() read it on the host once ``grads_on_host`` has happened, with no
        host read of device data (which would wait for all of backward queued so far)."""
        at, values = self._take_check(c, shard)
        host = self._verdict_room[c.index][:values.numel()]
        self._checks[c.index] = _ChunkCheck(at, host, device=values)
        return host, values

    def _host_check(self, c: Chunk, grads: torch.Tensor) -> "_ChunkCheck":
        """Worker or step(): ``c``'s check from its gradients on the host."""
        check = self._checks[c.index] = _ChunkCheck(*self._take_check(c, grads))
        return check

    def _applied(self) -> list[int]:
        return [i for i, speculation in self._speculations.items() if speculation.applied]

    def _commit(self, c: Chunk) -> None:
        """The speculation was right: the update stands; the upload copy follows it."""
        if c.shadow is not None:
            c.shadow.copy_(c.master)

    def _restore(self, c: Chunk, speculation: "_Speculation") -> None:
        """The speculation was wrong: put master, exp_avg and exp_avg_sq back exactly as they
        were before it (the segments it wrote)."""
        for lo, hi, _, _ in speculation.hypers:
            for dst, src in zip((c.master, c.exp_avg, c.exp_avg_sq), self._backup[c.index]):
                dst[lo:hi].copy_(src[lo:hi])

    def _rollback(self, c: Chunk) -> None:
        """Undo a speculative update entirely (states and step counts), now."""
        speculation = self._speculations.pop(c.index)
        if self.chunks.on_nvme(c):
            self.nvme.discard(c)          # its current place on the drive was never changed
            self.nvme.restore_master(c)   # fp32: the parameters, changed in place
        else:
            self._restore(c, speculation)
        for s, step in zip(c.slots, speculation.steps):
            s.step = step
        self.stats.rollbacks += 1

    def _trace(self, lane: str, what: str, label: str, start: float) -> None:
        if self.tracer is not None:
            self.tracer.add(lane, what, label, start, time.perf_counter())

    def _host_update(self, c: Chunk, coef, segments=None, what: str = "adam", use=None) -> None:
        self.streams.host_wait(c.grads_on_host)
        t = time.perf_counter()
        with self._pause(), self._held(c, use, "UPDATED"):
            self._update(c, self._host_grads(c), self.host_kernel, coef, segments=segments)
            if c.shadow is not None:
                c.shadow.copy_(c.master)      # the next upload's source: updated parameters
        self._trace("cpu_adam", what, f"chunk {c.index}", t)

    def _device_update(self, c: Chunk, coef) -> None:
        self._update(c, c.grad, self.device_kernel, coef)
        if c.master is not c.data:
            c.data.copy_(c.master)

    # ---- reading a gradient (DeepSpeed's safe_get_full_grad) ----------------------------------
    def local_gradient(self, p: nn.Parameter) -> torch.Tensor | None:
        """A copy of ``p``'s gradient summed over this rank's micro-batches of the step so far,
        not yet reduced over the ranks (fp32, on the chunk's device), as plain DeepSpeed ZeRO-0
        holds it in ``p.grad`` before its boundary all-reduce; None when none arrived since the
        last step or ``zero_grad``. Raises ``GradientNotHeld`` where no such tensor exists:
        an offloaded chunk's gradients on several ranks (reduced over them as they left the
        device) or at the boundary (handed to CPU Adam during the backward)."""
        if self.step_state is StepState.IDLE:
            return None
        c, s = self.chunks.slot_of[p]
        if not s.has_grad:
            return None
        if c.persistent:
            return c.grad[s.offset:s.stop].view(s.shape).clone()
        if self.chunks.dp.world > 1:
            raise GradientNotHeld(
                f"{s.name} is in an offloaded chunk, whose gradients are reduced over the "
                f"{self.chunks.dp.world} ranks as they leave the device (this rank keeps only its "
                f"shard of their average)")
        if self.boundary_backward_done or self.gas == 1 or c.grad_acc is None:
            raise GradientNotHeld(
                f"{s.name} is in an offloaded chunk, whose gradients of the boundary micro-batch "
                f"are handed to CPU Adam during the backward")
        self._wait_for_gradients()
        return c.grad_acc[s.offset:s.stop].view(s.shape).to(self.chunks.device, copy=True)

    # ---- clipping and overflow ----------------------------------------------------------------
    def _grad_view(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s gradient in its chunk (zeros where none arrived, as DeepSpeed fills them)."""
        c, s = self.chunks.slot_of[p]
        src = c.grad if c.persistent else self._host_grads(c)
        return src[s.offset:s.stop].view(s.shape)

    def _verdict(self, inv_scale: float) -> tuple[bool, torch.Tensor | None]:
        """Whether any gradient is not finite on any rank (fp16 loss scaling) and the global
        gradient norm (clipping; a 0-d host tensor), with one host read of device data for
        the whole step. The norm is taken even when the step overflows (it is not used then):
        reading both at once saves a synchronisation, and every rank runs the same
        collectives either way."""
        parts = []
        if self.loss_scaler is not None:
            parts.append(self._overflow_flag())
        if self.clip > 0:
            parts.append(self._global_norm(inv_scale).reshape(1))
        if not parts:
            return False, None
        host = self.streams.to_host(torch.cat(parts))
        overflow = self.loss_scaler is not None and bool(host[0] > 0)
        return overflow, (host[-1] if self.clip > 0 else None)

    def _global_norm(self, inv_scale: float) -> torch.Tensor:
        """DeepSpeed's clip_grad_norm_ arithmetic (deepspeed/runtime/utils.py): each
        parameter's norm, in module order, stacked, squared, summed, square-rooted, on the
        device. With several ranks the same, over gradients no rank holds whole
        (``_sharded_norms``), so the clipping coefficient is DeepSpeed ZeRO-0's to the bit."""
        if self.chunks.dp.world > 1:
            norms = self._sharded_norms()
        else:
            found = {}
            for i, p in enumerate(self.params_in_order):
                c, _ = self.chunks.slot_of[p]
                taken = self._checks.get(c.index)
                if taken is not None and i in taken.at:
                    found[i] = taken.norm(i)
                    continue
                g = self._grad_view(p)
                if g is not None:
                    found[i] = g.detach().float().norm(2)
            if not found:
                return torch.zeros(1, device=self.chunks.device)
            norms = self._stacked(found)
        total = norms.pow(2.0).sum().float().pow(1.0 / 2.0)
        total = total * 1.0 / 1.0
        return total * inv_scale if inv_scale != 1.0 else total

    def _stacked(self, norms: dict[int, torch.Tensor], length: int | None = None) -> torch.Tensor:
        """Per-parameter norms (module index -> 0-d fp32 tensor, on the host or the device)
        as one vector on the device in module order: those given, or every index below
        ``length`` with 0 for those missing. No host read: the host ones go up in one copy."""
        dev = self.chunks.device
        order = range(length) if length is not None else sorted(norms)
        up = [i for i in order if i in norms and norms[i].device.type == "cpu"] if dev.type != "cpu" else []
        if up:
            moved = self.streams.to_device(torch.stack([norms[i] for i in up]))
            norms = {**norms, **dict(zip(up, moved.unbind()))}
        zero = torch.zeros((), device=dev) if length is not None else None
        return torch.stack([norms.get(i, zero) for i in order])

    def _sharded_norms(self) -> torch.Tensor:
        """Every parameter's gradient norm, in module order, on every rank, as DeepSpeed
        ZeRO-0 computes it from the all-reduced gradient (every parameter has one then); on
        the device, with no host read.

        An offloaded chunk's gradient is reduce-scattered: a parameter wholly inside one
        rank's shard has its norm taken there; the few that straddle a shard boundary are
        assembled whole first (each rank adds its piece into a zeroed buffer, one all-reduce:
        x + 0 is exact). Persistent chunks are replicated: rank 0 takes theirs. The norms then
        meet in one all-reduce of a vector (one parameter per entry, non-zero on one rank)."""
        dp = self.chunks.dp
        params = self.params_in_order
        straddling = []               # (index, chunk, slot, offset in the assembly buffer)
        size = 0
        for i, p in enumerate(params):
            c, s = self.chunks.slot_of[p]
            if not c.persistent and s.offset // c.shard_size != (s.stop - 1) // c.shard_size:
                straddling.append((i, c, s, size))
                size += s.stop - s.offset
        whole = torch.zeros(size, dtype=torch.float32)
        for i, c, s, at in straddling:
            a, b = max(s.offset, c.shard_lo), min(s.stop, c.shard_hi)
            if a < b:
                whole[at + a - s.offset:at + b - s.offset].copy_(
                    self._host_grads(c)[a - c.shard_lo:b - c.shard_lo])
        if size:
            whole = dp.all_reduce_(self.streams.to_device(whole))
        norms = {}
        for i, p in enumerate(params):
            c, s = self.chunks.slot_of[p]
            if c.persistent:
                if dp.rank == 0:
                    norms[i] = c.grad[s.offset:s.stop].float().norm(2)
            elif c.index in self._checks and i in self._checks[c.index].at:
                norms[i] = self._checks[c.index].norm(i)
            elif c.shard_lo <= s.offset and s.stop <= c.shard_hi:
                norms[i] = self._host_grads(c)[s.offset - c.shard_lo:s.stop - c.shard_lo].float().norm(2)
        if dp.rank == 0:
            for i, c, s, at in straddling:
                norms[i] = whole[at:at + s.stop - s.offset].norm(2)
        return dp.all_reduce_(self._stacked(norms, len(params)))

    def _overflow_flag(self) -> torch.Tensor:
        """1.0 if any gradient is not finite on any rank, else 0.0: a one-element fp32 tensor
        on the device (the offloaded chunks' flags mostly taken during backward, on the host
        by now)."""
        dev = self.chunks.device
        on_device, bad = [], False
        for c in self.chunks.chunks:
            if c.persistent:
                on_device.append(_has_inf_or_nan(c.grad))
            elif c.sharded:
                on_device.append(_has_inf_or_nan(self._host_grads(c)[:c.shard_hi - c.shard_lo]))
            elif c.index in self._checks:
                bad = bad or not self._checks[c.index].finite
            elif not bad:             # on the host: a host read, no synchronisation
                bad = bool(_has_inf_or_nan(self._host_grads(c)[:c.shard_hi - c.shard_lo]))
        flag = torch.full((1,), float(bad), device=dev)
        if on_device:
            flag = torch.maximum(flag, torch.stack(on_device).any().float().reshape(1))
        return self.chunks.dp.all_reduce_(flag, dist_max())

    def _restore_params_after_skip(self) -> None:
        """Gradients may have landed over the host copy of the parameters; put it back (from
        the master on the drive for a chunk on NVMe)."""
        for c in self.chunks.streamed():
            if c.shadow is not None and c.grad_acc is None:
                with self.chunks.host_states(c):
                    c.shadow.copy_(c.master)
                self.chunks.device_states_written(c)


def interleaved(in_host: list, on_drive: list) -> list:
    """Both lists in one, each in its own order, those ``on_drive`` spread in proportion to
    the counts: the drive's next where its share of what was taken is not ahead, as
    ``_Pool.take`` and ``cost.time_state_io.nvme_turn`` decide."""
    out, h, d = [], 0, 0
    while h < len(in_host) or d < len(on_drive):
        if d < len(on_drive) and (d * len(in_host) <= h * len(on_drive) or h == len(in_host)):
            out.append(on_drive[d])
            d += 1
        else:
            out.append(in_host[h])
            h += 1
    return out


class _Pool:
    """Exact updates submitted in backward and not yet taken by the worker. Chunks in host
    memory: index -> the side lane's accumulation it waits for (or None), taken lowest first.
    Chunks with states on the drive: (index, accumulation, use) in the order their reads were
    wanted (the staging ring serves them in that order), interleaved with the others in
    proportion to their counts (``cost.time_state_io.nvme_turn``, the same rule): while the
    worker updates a chunk in host memory the drive reads the next one's states. The main
    thread adds, the worker takes."""

    def __init__(self, on_drive: list[bool]):
        """``on_drive``: per offloaded chunk, whether its states are on the drive."""
        self._pending: dict[int, threading.Event | None] = {}
        self._drive: deque = deque()
        self._totals = (sum(on_drive), len(on_drive) - sum(on_drive))
        self._taken = [0, 0]
        """This round's updates taken from the drive and from host memory (a round ends when
        the pool empties: one step's updates)."""
        self._lock = threading.Lock()

    def add(self, i: int, accumulated: threading.Event | None, use=None) -> None:
        with self._lock:
            if use is None:
                self._pending[i] = accumulated
            else:
                self._drive.append((i, accumulated, use))

    def take(self):
        """(index, accumulation, use): the next on the drive where its turn has come (or
        nothing else is pending), else the lowest in host memory whose gradients are
        accumulated (else the lowest). Removed."""
        with self._lock:
            drive = bool(self._drive)
            behind = self._taken[0] * self._totals[1] <= self._taken[1] * self._totals[0]
            if drive and (behind or not self._pending):
                self._taken[0] += 1
                item = self._drive.popleft()
            else:
                self._taken[1] += 1
                done = [i for i, e in self._pending.items() if e is None or e.is_set()]
                i = min(done or self._pending)
                item = (i, self._pending.pop(i), None)
            if not self._drive and not self._pending:
                self._taken = [0, 0]
            return item


def _has_inf_or_nan(x: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's test (deepspeed.runtime.utils.has_inf_or_nan), as a tensor on ``x``'s
    device (no synchronisation): reduce, then look - the maximum propagates NaN and shows +inf,
    the minimum shows -inf - in one pass, ~8x faster on a CPU than an elementwise isfinite()."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=x.device)
    lo, hi = torch.aminmax(x)
    return ~(torch.isfinite(lo) & torch.isfinite(hi))


@dataclass
class _ChunkCheck:
    """An offloaded chunk's part of the step's verdict (``ChunkOptimizer._take_check``), on the
    host. Taken on the device, it is copied there on the offload queue just before the
    gradients: read it only once ``grads_on_host`` has been waited for."""
    at: dict[int, int]
    """Parameter index (module order) -> position of its gradient's norm in ``values``, for
    the chunk's parameters held whole in this rank's shard (with clipping; else empty)."""
    values: torch.Tensor
    """Host fp32: [1.0 if any gradient of the shard is not finite else 0.0, norms...]."""
    device: torch.Tensor | None = None
    """The device vector the copy reads, kept alive until the step is over (the copy is done
    by then; on CUDA the allocator would hand a dropped one to the next tensor at once)."""

    @property
    def finite(self) -> bool:
        return float(self.values[0]) == 0.0

    def norm(self, i: int) -> torch.Tensor:
        return self.values[self.at[i]]


@dataclass
class _Speculation:
    steps: list[int]
    """The chunk's slots' step counts before the update."""
    hypers: list
    """Each segment's (bounds, step, hyperparameters) it was updated with."""
    applied: bool = False
    """False when the gradients were not finite (the step overflows: nothing to undo)."""


@dataclass
class OverlapStats:
    """What CPU Adam's overlap did (``engine.protrain_stats()``)."""
    overlapped_chunks: int = 0
    """Offloaded chunk updates that ran during backward and stood (cumulative)."""
    rollbacks: int = 0
    """Speculative chunk updates undone (clipping, overflow or changed hyperparameters)."""
    reductions_overlapped: int = 0
    """Persistent chunks' gradient all-reduces (several ranks) started during backward, as the
    chunk's backward ended, rather than in ``step()`` (cumulative)."""
    exposed_s: float = 0.0
    """The CPU Adam work the last step's compute did not hide: its forward's and backward's
    waits for the chunks' updates the step before carried over (a forward needs a chunk whose
    update still runs), plus its ``step()``'s wall time less the device Adam's. (Until the
    first GPU run showed 11 ms here against GPU idle gaps of ~117 ms per step, the waits were
    overwritten by ``step()``'s time.)"""


def _bind_worker(streams: Streams, host_kernel, share: float = 1.0) -> None:
    """The host worker thread's setup: the runtime's device, and the rank's share of the
    node's cores for the OpenMP regions it starts - the kernel's and the passes around it
    (copies into the upload region, zeroing), which the cost model prices at that share.
    ``share``: the fraction of them (the side lane's accumulations, a memory-bound add beside
    CPU Adam, take a quarter)."""
    streams.bind_thread()
    threads = getattr(host_kernel, "threads", 0)
    if threads:
        from .host_threads import set_thread_count
        set_thread_count(max(1, int(threads * share)))


def dist_max():
    import torch.distributed as dist
    return dist.ReduceOp.MAX


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
