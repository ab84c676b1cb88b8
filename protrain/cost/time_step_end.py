"""The step's end in the step-time model (``cost.time_model``): the CPU Adam updates backward
left (clipping / fp16, and the redos of a wrong speculation), the device's Adam over the
persistent chunks after the rest of their gradients' all-reduce (T_gpu_optim), and the iteration time -
with ``carry_over``, the CPU Adam still running when the step ends runs on into the next
forward, which waits only where an offloaded chunk's upload needs its update."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .time_queues import QueueState, StepCosts
from .time_state_io import drive_floor, staged_turn, staged_update


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
    prefix = np.concatenate([[0], np.cumsum(layout.used)])
    # Device tail at the boundary: the persistent gradients' all-reduces still running when
    # backward's compute ends (started as each chunk's backward ended), then device Adam.
    gpu_optim = (prefix[npers] / costs.rr.device_adam + np.maximum(q.net - bwd_end, 0.0)
                 if costs.optimizer_step else np.zeros(costs.k_plans))
    if costs.inline:                  # one timeline: CPU Adam, then the "device" Adam
        device_end = np.maximum(bwd_end, q.cpu) + gpu_optim
    else:
        device_end = bwd_end + gpu_optim
    q.record("compute", "device_adam", "persistent chunks", device_end - gpu_optim, device_end)
    iter_time = np.maximum(device_end, q.cpu)
    # Exposed: CPU Adam past the device's own work. On one timeline (a CPU "device") that is
    # the updates left for after backward (the inline ones count as backward's time).
    exposed = np.maximum(q.cpu - (bwd_end if costs.inline else device_end), 0.0)
    carries = costs.carry_over and costs.optimizer_step and not costs.inline and layout.n_chunks
    if carries:
        offl_rows = np.arange(layout.n_chunks)[:, None] >= npers[None, :]
        late = np.where(offl_rows, q.done_at - device_end[None, :] - q.up_start, -np.inf).max(axis=0)
        carried = np.maximum(device_end + np.maximum(late, 0.0), q.cpu_busy)
        iter_time = np.minimum(iter_time, carried)
    iter_time = drive_floor(costs, q, iter_time)
    if carries:
        exposed = np.maximum(iter_time - device_end, 0.0)
    return StepEnd(iter_time=iter_time, gpu_optim_time=gpu_optim, cpu_optim_exposed=exposed)


def _deferred_updates(costs: StepCosts, q: QueueState, bwd_end: np.ndarray) -> None:
    """The updates left for after backward, each after its gradient landed and backward ended:
    the CPU queue's end in the order backward issued them; each chunk's own end (``done_at``,
    the trace) in chunk order, the order the runtime runs what step() leaves (the next
    forward's upload order)."""
    t_adam = costs.t_adam
    tail = np.maximum(q.cpu, bwd_end)
    for c, offl, d_end, extra in q.deferred:
        turn = staged_turn(costs, c, t_adam[c])
        c_end = np.maximum(np.maximum(q.cpu, d_end), bwd_end) + turn + extra
        q.cpu = np.where(offl, c_end, q.cpu)
        q.cpu_busy += np.where(offl, turn + extra, 0.0)
    for c, offl, d_end, extra in sorted(q.deferred, key=lambda d: d[0]):
        start = np.maximum(tail, d_end)
        q.record("cpu_adam", "rollback", f"chunk {c}", start, start + extra, offl & (np.asarray(extra) > 0))
        # States on the drive are read before the update and written back after it (their
        # rollback is the read itself: the old slot).
        u_end, turn = staged_update(costs, q, c, offl, start + extra, d_end, t_adam[c])
        tail = np.where(offl, u_end, tail)
        q.done_at[c] = np.where(offl, tail, q.done_at[c])
        redo = costs.speculation_wrong and c >= np.asarray(costs.spec_from).reshape(-1)[0]
        q.record("cpu_adam", "redo" if redo else "adam", f"chunk {c}", tail - turn, tail, offl)
