"""CPU Adam's pipeline over the chunks whose optimizer states live on the drive (``Knobs.n_nvme``,
``protrain.state_tier``), for the step-time model (``cost.time_model``).

The runtime streams such a chunk's states through ``STAGING_SLOTS`` pinned buffers, one *use*
of a chunk's states per buffer: the read of a use starts once it is wanted (its update was
queued: as its gradients land, or at the step's verdict) and the buffer of the use
``STAGING_SLOTS`` before it is free (its write-back done), after the reads wanted before it;
the update waits for its read; the write-back follows the update. The model runs the same
pipeline per plan (``staged_update``), in the order the CPU queue takes the chunks:

- the CPU queue interleaves the chunks on the drive with those in host memory, in proportion
  to their counts (``runtime.optimizer``'s pool, ``nvme_turn``): while it updates a chunk in
  host memory the drive reads the next one's states, so neither waits for the other where
  the work allows - the step tends to the larger of CPU Adam's time and the drive's;
- the drive is one queue for reads and write-backs (``HardwareProfile.nvme_duplex`` False:
  what a drive does unless its probe found both directions at full speed together), served
  in the order they are issued; with ``nvme_duplex`` the directions are two queues.

The drive's time is shared with the activation tier (``n_ssd``): its reads and writes of
activations and of states together are a floor under the step (``drive_floor``): the sum of
both directions, or the busier of the two with ``nvme_duplex``.

A speculating NVMe chunk needs no backup: its speculative states go to the other slot on the
drive (``state_tier.NVME_STATE_SLOTS``), and a rollback reads the old slot, which is the read
the redo makes anyway.
"""
from __future__ import annotations

import numpy as np

from .time_queues import QueueState, StepCosts


def nvme_turn(taken: np.ndarray, totals: np.ndarray, has_drive: np.ndarray, has_host: np.ndarray) -> np.ndarray:
    """Per plan: whether the CPU queue takes a chunk on the drive next (else one in host memory):
    where the drive's chunks are not ahead of their share of the turns taken so far
    (``taken``, ``totals``: [2, K] chunks on the drive / in host memory), or nothing else is
    pending. The runtime's pool decides by the same rule (``runtime.optimizer._Pool``)."""
    behind = taken[0] * totals[1] <= taken[1] * totals[0]
    return has_drive & (behind | ~has_host)


def staged_update(costs: StepCosts, q: QueueState, rows: np.ndarray, j, want, cpu_free, ready,
                  t_turn) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of the update of the chunks ``j`` on the drive (one per plan of ``rows``):
    its read wanted at ``want``, the CPU free at ``cpu_free``, its gradients on the host at
    ``ready``, ``t_turn`` its time on the CPU queue. Issues the read and the write-back on the
    drive (``QueueState.drive_q``, ``slots``) and counts them in its busy time."""
    t_r, t_w = costs.t_sread[j], costs.t_swrite[j]
    r_iss = np.maximum(want, q.slots[0, rows])              # the buffer of the use 3 before it
    if costs.hw.nvme_duplex:
        r_end = np.maximum(q.drive_q[0, rows], r_iss) + t_r
        q.drive_q[0, rows] = r_end
    else:
        # One queue: this read and the last use's write-back, in the order they were issued.
        dq, w_iss, w_len = q.drive_q[0, rows], q.w_iss[rows], q.w_len[rows]
        read_first = r_iss <= w_iss
        r_a = np.maximum(dq, r_iss) + t_r
        w_a = np.maximum(r_a, w_iss) + w_len
        w_b = np.maximum(dq, w_iss) + w_len
        r_b = np.maximum(w_b, r_iss) + t_r
        r_end = np.where(read_first, r_a, r_b)
        w_prev = np.where(read_first, w_a, w_b)
        q.drive_q[0, rows] = np.maximum(r_end, w_prev)
        q.slots[-1, rows] = w_prev                          # the last use's buffer free
    start = np.maximum(np.maximum(cpu_free, ready), r_end)
    end = start + t_turn
    if costs.hw.nvme_duplex:
        w_end = np.maximum(q.drive_q[1, rows], end) + t_w
        q.drive_q[1, rows] = w_end
        q.w_iss[rows] = w_end
    else:
        q.w_iss[rows], q.w_len[rows] = end, t_w
    q.slots[:-1, rows] = q.slots[1:, rows]                  # the ring moves on by one use
    q.slots[-1, rows] = np.inf if not costs.hw.nvme_duplex else q.w_iss[rows]
    q.drive_busy[0, rows] += t_r
    q.drive_busy[1, rows] += t_w
    if q.trace is not None and len(rows) and rows[0] == 0:
        first = lambda x: float(np.asarray(x).reshape(-1)[0])   # noqa: E731  (plan 0)
        label = f"chunk {int(np.asarray(j).reshape(-1)[0])}"
        q.record("nvme", "read states", label, first(r_end) - first(t_r), first(r_end))
        q.record("nvme", "write states", label, first(end), first(end) + first(t_w))
    return start, end


def staged_update_masked(costs: StepCosts, q: QueueState, c: int, which: np.ndarray, want, cpu_free,
                         ready, t_turn) -> tuple[np.ndarray, np.ndarray]:
    """``staged_update`` of chunk c for the plans ``which`` where it is on the drive; the others
    start at max(``cpu_free``, ``ready``). Returns (end, length) of its turn, per plan."""
    start = np.maximum(cpu_free, ready)
    end = start + t_turn
    rows = np.flatnonzero(which & costs.on_drive(c)) if costs.any_nvme else ()
    if len(rows):
        s, e = staged_update(costs, q, rows, c, at_rows(want, rows), at_rows(cpu_free, rows),
                             at_rows(ready, rows), at_rows(t_turn, rows))
        start, end = start.copy(), end.copy()
        start[rows], end[rows] = s, e
    return end, end - start


def at_rows(x, rows: np.ndarray):
    """``x`` (per plan, or one value for all) at plans ``rows``."""
    return x[rows] if np.ndim(x) else x


def drain_drive(costs: StepCosts, q: QueueState) -> None:
    """The last write-back of each plan, on a drive shared by both directions."""
    if not costs.hw.nvme_duplex:
        q.drive_q[0] = np.maximum(q.drive_q[0], q.w_iss) + q.w_len
        q.w_len[:] = 0.0


def drive_floor(costs: StepCosts, q: QueueState, iter_time: np.ndarray) -> np.ndarray:
    """``iter_time``, at least the drive's busy time where a plan keeps states on the drive:
    both directions together, or the busier one where they are independent."""
    return np.where(costs.nnvme > 0, np.maximum(iter_time, drive_time(costs, q)), iter_time)


def drive_time(costs: StepCosts, q: QueueState) -> np.ndarray:
    """[K] seconds the drive is busy in a step (``drive_floor``)."""
    return q.drive_busy.max(axis=0) if costs.hw.nvme_duplex else q.drive_busy.sum(axis=0)
