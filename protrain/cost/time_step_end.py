"""The step's end in the step-time model (``cost.time_model``): the CPU Adam updates backward
left (clipping / fp16, and the redos of a wrong speculation), the device's Adam over the
persistent chunks after the rest of their gradients' all-reduce (T_gpu_optim), and the iteration time -
with ``carry_over``, the CPU Adam still running when the step ends runs on into the next
forward, which waits only where an offloaded chunk's upload needs its update."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .time_queues import QueueState, StepCosts
from .time_backward import push_pending, push_drive, serve_pending
from .time_state_io import drain_drive, drive_floor


@dataclass(frozen=True, slots=True)
class StepEnd:
    """Seconds, per plan."""

    iter_time: np.ndarray
    gpu_optim_time: np.ndarray
    cpu_optim_exposed: np.ndarray


def simulate_step_end(costs: StepCosts, q: QueueState, bwd_end: np.ndarray) -> StepEnd:
    """Run the updates left for after backward and the device's Adam; the iteration's end."""
    _deferred_updates(costs, q, bwd_end)
    layout, npers = costs.layout, costs.npers
    # Device tail at the boundary: the persistent gradients' all-reduces still running when
    # backward's compute ends (started as each chunk's backward ended) or the sharded chunks'
    # reduce-scatters, then device Adam.
    gpu_optim = (costs.adam_elements / costs.rr.device_adam
                 + np.maximum(np.maximum(q.net, q.shard_down) - bwd_end, 0.0)
                 if costs.optimizer_step else np.zeros(costs.k_plans))
    dispatch = _dispatch(costs, q)
    if costs.inline:                  # one timeline: CPU Adam, then the "device" Adam
        device_end = np.maximum(bwd_end, q.cpu) + gpu_optim
    else:                             # step() queues the deferred updates, then device Adam
        device_end = bwd_end + dispatch + gpu_optim
    if q.trace is not None:
        q.record("compute", "step", "updates queued after the verdict", bwd_end, bwd_end + dispatch,
                 dispatch > 0)
        q.record("compute", "device_adam", "persistent chunks", device_end - gpu_optim, device_end)
    iter_time = np.maximum(device_end, q.cpu)
    # Exposed: CPU Adam past the device's own work, and step()'s queuing of it on the training
    # thread (the runtime counts both). On one timeline (a CPU "device") that is the updates
    # left for after backward (the inline ones count as backward's time).
    exposed = np.maximum(q.cpu - (bwd_end if costs.inline else device_end), 0.0) + dispatch
    carries = costs.carry_over and costs.optimizer_step and not costs.inline and layout.n_chunks
    if carries:
        offl_rows = np.arange(layout.n_chunks)[:, None] >= npers[None, :]
        late = np.where(offl_rows, q.done_at - device_end[None, :] - q.up_start, -np.inf).max(axis=0)
        carried = np.maximum(device_end + np.maximum(late, 0.0), q.cpu_busy)
        iter_time = np.minimum(iter_time, carried)
    iter_time = drive_floor(costs, q, iter_time)
    if carries:
        exposed = np.maximum(iter_time - device_end, 0.0) + dispatch
    return StepEnd(iter_time=iter_time, gpu_optim_time=gpu_optim, cpu_optim_exposed=exposed)


def _dispatch(costs: StepCosts, q: QueueState) -> np.ndarray | float:
    """Seconds step() spends on the training thread queuing the updates left for after the
    verdict, per plan: where they run on a worker beside compute (inline they are priced in
    each update's own time)."""
    if costs.inline or not costs.optimizer_step or not q.deferred or not costs.rr.step_dispatch:
        return 0.0
    n = np.sum([np.asarray(offl, dtype=float) for _, offl, _, _ in q.deferred], axis=0)
    return n * costs.rr.step_dispatch


def _deferred_updates(costs: StepCosts, q: QueueState, bwd_end: np.ndarray) -> None:
    """The updates left for after backward, each after its gradient landed and backward ended,
    in the order the runtime runs what step() leaves: those in host memory in chunk order
    (the next forward's upload order), interleaved in proportion with those on the drive,
    also in chunk order, their reads wanted at the verdict (``serve_pending``)."""
    if not q.deferred:
        drain_drive(costs, q)
        return
    if not costs.any_nvme:
        _deferred_in_host(costs, q, bwd_end)
        return
    some = np.logical_or.reduce([offl for _, offl, _, _ in q.deferred])
    q.cpu = np.where(some, np.maximum(q.cpu, bwd_end), q.cpu)     # after the verdict
    q.taken[:] = 0.0
    q.totals[:] = 0.0
    for c, offl, d_end, extra in sorted(q.deferred, key=lambda d: d[0], reverse=True):
        drive = offl & costs.on_drive(c)
        push_pending(q, c, offl & ~drive, d_end, extra)
        q.totals[1] += offl & ~drive
    for c, offl, d_end, extra in sorted(q.deferred, key=lambda d: d[0]):
        drive = offl & costs.on_drive(c)
        push_drive(q, c, drive, d_end, bwd_end, extra)
        q.totals[0] += drive
    redo_from = (np.asarray(costs.spec_from).reshape(-1)[0]
                 if costs.speculation_wrong and costs.spec_from is not None else None)
    serve_pending(costs, q, np.inf,
                  label=lambda j: "redo" if redo_from is not None and j >= redo_from else "adam")
    drain_drive(costs, q)


def _deferred_in_host(costs: StepCosts, q: QueueState, bwd_end: np.ndarray) -> None:
    """``_deferred_updates`` where no plan keeps states on the drive: in chunk order."""
    tail = np.maximum(q.cpu, bwd_end)
    redo_from = (np.asarray(costs.spec_from).reshape(-1)[0]
                 if costs.speculation_wrong and costs.spec_from is not None else None)
    for c, offl, d_end, extra in sorted(q.deferred, key=lambda d: d[0]):
        start = np.maximum(tail, d_end) + extra
        end = start + costs.t_adam[c]
        tail = np.where(offl, end, tail)
        q.done_at[c] = np.where(offl, end, q.done_at[c])
        q.cpu_busy += np.where(offl, costs.t_adam[c] + extra, 0.0)
        if q.trace is not None:
            q.record("cpu_adam", "rollback", f"chunk {c}", start - extra, start, offl & (np.asarray(extra) > 0))
        if q.trace is not None:
            q.record("cpu_adam", "redo" if redo_from is not None and c >= redo_from else "adam",
                     f"chunk {c}", start, end, offl)
    q.cpu = np.where(np.logical_or.reduce([offl for _, offl, _, _ in q.deferred]), tail, q.cpu)
