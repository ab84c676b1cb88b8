"""Gradients and Adam on chunks: where each gradient goes, and when each chunk is updated.

- A persistent chunk's gradients are added into its fp32 gradient buffer on the device and
  updated there by the device Adam after backward.
- An offloaded chunk's gradients are written into its device buffer over the parameters
  (backward no longer needs them once their gradient exists), copied to the host when the
  chunk's backward is done, and updated by CPU Adam: as soon as they land (overlapping the
  rest of backward) when nothing global is needed first, else in ``step`` once the global
  gradient norm (clipping) or the overflow check (fp16) is known.
- With gradient accumulation, each micro-batch's gradients are added into an fp32 host
  accumulator; Adam runs on the accumulation boundary.

Gradient clipping reproduces DeepSpeed's ``clip_grad_norm_`` exactly (per-parameter norms in
module order, stacked, combined, ``max_norm / (norm + 1e-6)`` capped at 1), so fp32 runs match
DeepSpeed bit for bit. fp16 uses DeepSpeed's own dynamic loss scaler.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import torch
from torch import nn

from .adam import AdamHyper
from .chunks import Chunk, ChunkManager
from .streams import Streams

log = logging.getLogger("protrain")


class HostWorker:
    """Runs host-side work (gradient accumulation, CPU Adam) in order, on a thread when a GPU
    keeps computing meanwhile, inline on CPU-only machines.

    After a task fails the remaining ones are skipped (their inputs may be inconsistent) and
    the error is raised by the next ``drain``; ``on_error`` callbacks wake whoever waits for
    something only a skipped task would have given back."""

    def __init__(self, threaded: bool, bind: Callable[[], None] | None = None):
        self.threaded = threaded
        self._error: BaseException | None = None
        self._on_error: list[Callable[[], None]] = []
        if threaded:
            self._q: queue.Queue = queue.Queue()
            self._t = threading.Thread(target=self._run, args=(bind,), name="protrain-host",
                                       daemon=True)
            self._t.start()

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

    def _run(self, bind) -> None:
        if bind is not None:
            try:
                bind()                # this thread's device calls go to the runtime's device
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread in drain()
                self._fail(e)
        while True:
            fn = self._q.get()
            try:
                if fn is not None and self._error is None:
                    fn()
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread in drain()
                self._fail(e)
            finally:
                self._q.task_done()
            if fn is None:
                return

    def submit(self, fn: Callable[[], None]) -> None:
        if self.threaded:
            self._q.put(fn)
        else:
            fn()

    def drain(self) -> None:
        if self.threaded:
            self._q.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("protrain: host-side optimizer work failed") from err

    def close(self) -> None:
        if self.threaded:
            self._q.put(None)
            self._t.join(timeout=10)


class ChunkOptimizer:
    def __init__(self, manager: ChunkManager, streams: Streams, *, param_groups: list[dict],
                 hyper: Callable[[dict], AdamHyper], host_kernel, device_kernel,
                 grad_accumulation_steps: int, clip: float, loss_scaler,
                 params_in_order: list[nn.Parameter], pause_accounting=None):
        self.m = manager
        self.streams = streams
        self.param_groups = param_groups
        self.hyper = hyper
        self.host_kernel = host_kernel
        self.device_kernel = device_kernel
        self.gas = grad_accumulation_steps
        self.clip = clip
        self.loss_scaler = loss_scaler
        self.params_in_order = params_in_order
        self.worker = HostWorker(threaded=streams.asynchronous, bind=streams.bind_thread)
        self._pause = pause_accounting or (lambda: _nullcontext())
        self.overlap = clip <= 0 and loss_scaler is None
        # The first optimizer step after a (re)plan updates nothing during backward: an out-of-
        # memory error there can then be redone exactly (no chunk already stepped).
        self.probation = True
        # Staging for accumulation: gradients land here, then are added on the host.
        self._staging: list[torch.Tensor] = []
        self._staging_free: list[int] = []
        if self.gas > 1 and self.m.offloaded():
            cap = max(c.shard_size for c in self.m.offloaded())
            self._staging = [streams.pinned(cap, self.m.dtype) for _ in range(2)]
            self._staging_free = [0, 1]
            self._staging_lock = threading.Condition()
            self.worker.on_error(self._wake_staging)
        self._queued: set[int] = set()
        """Offloaded chunks whose CPU Adam update of this step was submitted (main thread's
        view: the worker may still be running it)."""
        self._late: set[int] = set()
        """Offloaded chunks that received a gradient after their backward was declared done
        (a parameter used outside the part it was profiled in): updated in ``step`` only,
        once every gradient exists."""
        self._dirty = False   # gradients arrived since the last reset
        self._dirty_before_forward = False   # ... before the current micro-batch
        self.overflow = False
        self.global_grad_norm: float | None = None

    # ---- backward ------------------------------------------------------------------------
    def on_grad(self, p: nn.Parameter) -> None:
        """post_accumulate_grad hook: move the gradient into its chunk."""
        g = p.grad
        if g is None:
            return
        c, s = self.m.slot_of[p]
        with torch.no_grad():
            if c.persistent:
                c.grad[s.offset:s.stop].add_(g.reshape(-1))
            elif c.buffer is not None and c.state.value == "resident":
                self.m.pool.tensors[c.buffer][s.offset:s.stop].copy_(g.reshape(-1))
            elif self.m.dp.world > 1:
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
                target = self._landing(c)
                target[s.offset:s.stop].add_(g.reshape(-1).to(target.device, target.dtype))
        s.has_grad = True
        self._dirty = True
        p.grad = None

    def _landing(self, c: Chunk) -> torch.Tensor:
        return c.grad_acc if c.grad_acc is not None else c.shadow

    def chunk_backward_done(self, c: Chunk, boundary: bool) -> None:
        """All gradients of ``c`` for this micro-batch exist."""
        if c.persistent or c.state.value != "resident":
            return
        if self.gas == 1:
            self.m.offload_grads(c, self._landing(c))
        else:
            slot = self._take_staging()
            self.m.offload_grads(c, self._staging[slot][:c.shard_size])
            self.worker.submit(lambda c=c, slot=slot: self._accumulate(c, slot))
        if boundary and self.overlap and not self.probation and c.index not in self._queued \
                and c.index not in self._late:
            self._queued.add(c.index)
            self.worker.submit(lambda c=c: self._host_update(c, coef=None))

    def can_redo_micro_batch(self) -> bool:
        """Whether this micro-batch's backward can be dropped and run again exactly: no chunk
        update of the step has been submitted (the worker may be running one: that is as good
        as applied), and no gradient of an earlier micro-batch is mixed with this one's."""
        return not self._queued and not (self.gas > 1 and self._dirty_before_forward)

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

    def _accumulate(self, c: Chunk, slot: int) -> None:
        self.streams.host_wait(c.grads_on_host)
        c.grad_acc.add_(self._staging[slot][:c.shard_size])
        with self._staging_lock:
            self._staging_free.append(slot)
            self._staging_lock.notify()

    # ---- step ------------------------------------------------------------------------------
    def step(self) -> None:
        """The accumulation boundary's update. Sets ``overflow`` and ``global_grad_norm``."""
        self.worker.drain()
        for c in self.m.offloaded():
            self.streams.host_wait(c.grads_on_host)
        self.overflow = False
        self.global_grad_norm = None
        inv_scale = 1.0 / self.loss_scaler.cur_scale if self.loss_scaler is not None else 1.0
        coef = None
        dp = self.m.dp
        with self._pause():
            if dp.world > 1:
                for c in self.m.chunks:
                    if c.persistent:    # replicated: average the gradients over ranks
                        dp.all_reduce_(c.grad).div_(dp.world)
            if self.loss_scaler is not None:
                self.overflow = self._has_overflow()
                self.loss_scaler.update_scale(self.overflow)
                if self.overflow:
                    log.info("protrain: fp16 overflow, step skipped; loss scale now %s",
                             self.loss_scaler.cur_scale)
                    self._restore_params_after_skip()
                    self._reset()
                    return
            if self.clip > 0:
                norm = self._global_norm(inv_scale)
                self.global_grad_norm = float(norm)
                max_norm = torch.tensor([float(self.clip)], device=norm.device)
                clip_coef = torch.min(torch.tensor([1.0], device=norm.device), max_norm / (norm + 1e-6))
                coef = clip_coef if inv_scale == 1.0 else clip_coef * inv_scale
            elif inv_scale != 1.0:
                coef = torch.tensor([inv_scale])
            for c in self.m.offloaded():
                if c.index not in self._queued:
                    self._queued.add(c.index)
                    self.worker.submit(lambda c=c, coef=coef: self._host_update(c, coef))
            for c in self.m.chunks:
                if c.persistent:
                    self._device_update(c, coef)
            self.worker.drain()
        self._reset()
        self.probation = False

    def _reset(self) -> None:
        self._queued.clear()
        if not self._dirty:
            return
        self._dirty = False
        for c in self.m.chunks:
            if c.persistent:
                c.grad.zero_()
            elif c.grad_acc is not None:
                c.grad_acc.zero_()
            for s in c.slots:
                s.has_grad = False

    def zero_grad(self) -> None:
        """Gradients are cleared by ``step``; an explicit zero_grad between micro-batches (not
        at a boundary) discards the accumulated ones, as torch's would."""
        self.worker.drain()
        self._reset()

    def _segments(self, c: Chunk):
        """Contiguous runs of parameters (their part in this rank's shard) with a gradient, one
        param group and one step count, in the coordinates of the chunk's local tensors."""
        lo, hi = (0, c.numel) if c.persistent else (c.shard_lo, c.shard_hi)
        run = None
        for s in c.slots:
            a, b = max(s.offset, lo) - lo, min(s.stop, hi) - lo
            if a >= b:
                continue
            if not (s.has_grad or self.m.dp.world > 1):
                if run:
                    yield run
                run = None
                continue
            if run and run[2] == s.group and run[3] == s.step and run[1] == a:
                run[1] = b
            else:
                if run:
                    yield run
                run = [a, b, s.group, s.step]
        if run:
            yield run

    def _update(self, c: Chunk, grads: torch.Tensor, kernel, coef) -> None:
        for lo, hi, group, step in list(self._segments(c)):
            # fp32 gradient regions are ours to scale in place (they are zeroed after the step);
            # 16-bit ones are converted into a temporary first.
            g = grads[lo:hi]
            g = g.float() if g.dtype != torch.float32 else g
            if coef is not None:
                g.mul_(coef.to(g.device))
            kernel.update(c.master[lo:hi], g, c.exp_avg[lo:hi], c.exp_avg_sq[lo:hi], step + 1,
                          self.hyper(self.param_groups[group]))
        for s in c.slots:
            if s.has_grad or self.m.dp.world > 1:
                s.step += 1

    def _host_update(self, c: Chunk, coef) -> None:
        self.streams.host_wait(c.grads_on_host)
        with self._pause():
            self._update(c, self._landing(c), self.host_kernel, coef)
            if c.shadow is not None:
                c.shadow.copy_(c.master)      # the next upload's source: updated parameters

    def _device_update(self, c: Chunk, coef) -> None:
        self._update(c, c.grad, self.device_kernel, coef)
        if c.master is not c.data:
            c.data.copy_(c.master)

    # ---- clipping and overflow ----------------------------------------------------------------
    def _grad_view(self, p: nn.Parameter) -> torch.Tensor | None:
        c, s = self.m.slot_of[p]
        if not s.has_grad:
            return None
        src = c.grad if c.persistent else self._landing(c)
        return src[s.offset:s.stop].view(s.shape)

    def _global_norm(self, inv_scale: float) -> torch.Tensor:
        """DeepSpeed's clip_grad_norm_ arithmetic (deepspeed/runtime/utils.py) for one rank;
        with several, the sum of squares over every shard and, once, over the replicated
        chunks, all-reduced."""
        dp = self.m.dp
        if dp.world > 1:
            sq = torch.zeros(1, dtype=torch.float64)
            for c in self.m.chunks:
                if c.persistent:
                    if dp.rank == 0:
                        sq += c.grad.double().pow(2).sum().cpu()
                else:
                    sq += self._landing(c)[:c.shard_hi - c.shard_lo].double().pow(2).sum()
            total = dp.all_reduce_(sq.to(self.m.device)).sqrt().float().cpu()
            return total * inv_scale if inv_scale != 1.0 else total
        norms = []
        for p in self.params_in_order:
            g = self._grad_view(p)
            if g is not None:
                n = g.detach().float().norm(2)
                norms.append(n.cpu() if n.device.type != "cpu" else n)
        if not norms:
            return torch.tensor([0.0])
        total = torch.stack(norms).pow(2.0).sum().float().pow(1.0 / 2.0)
        total = total * 1.0 / 1.0
        return total * inv_scale if inv_scale != 1.0 else total

    def _has_overflow(self) -> bool:
        dp = self.m.dp
        if dp.world > 1:
            bad = any(not bool(torch.isfinite(c.grad if c.persistent else self._landing(c)).all())
                      for c in self.m.chunks)
            flag = dp.all_reduce_(torch.tensor([float(bad)], device=self.m.device), dist_max())
            return bool(flag.item() > 0)
        for p in self.params_in_order:
            g = self._grad_view(p)
            if g is not None and not bool(torch.isfinite(g).all()):
                return True
        return False

    def _restore_params_after_skip(self) -> None:
        """Gradients may have landed over the host copy of the parameters; put it back."""
        for c in self.m.offloaded():
            if c.shadow is not None and c.grad_acc is None:
                c.shadow.copy_(c.master)


def dist_max():
    import torch.distributed as dist
    return dist.ReduceOp.MAX


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
