"""CPU Adam's pipeline over the chunks whose optimizer states live on the drive (``Knobs.n_nvme``,
``protrain.state_tier``), for the step-time model (``cost.time_model``).

The runtime streams such a chunk's states through ``STAGING_SLOTS`` pinned buffers: it reads
chunk k+1 while CPU Adam updates chunk k and chunk k-1 is written back. The model prices the
pipeline's steady state, in the order the CPU queue takes the chunks:

- an NVMe chunk's turn on the CPU queue is max(its update, its read, its write-back): with a
  buffer for each of the three, the drive's read and write streams run beside the updates,
  and the slowest of the three sets the pace;
- the first read runs ahead of the first update (prefetched from the step's start, during
  forward): no NVMe update starts before its own read could have ended;
- the last write-back runs after the last update. Nothing in the step waits for it: the
  updated parameters the next forward uploads are in host memory, and the states written
  back are next read by the same chunk's update a step later, after every other NVMe chunk's.

The drive's two directions are shared with the activation tier (``n_ssd``): its reads and
writes of activations and of states together are a floor under the step (``drive_floor``) -
in steady state a step cannot move more bytes through the drive than its bandwidth allows.
The steady state leaves out the pipeline's start-up and the stalls where the drive is busy
with activations at the moment a read is due (a bound by the drive's throughput, not a
simulation of its queue); the search's bounds add up the same terms, so they stay tight.

A speculating NVMe chunk needs no backup: its speculative states go to the other slot on the
drive (``state_tier.NVME_STATE_SLOTS``), and a rollback reads the old slot, which is the read
the redo makes anyway.
"""
from __future__ import annotations

import numpy as np

from .time_queues import QueueState, StepCosts


def staged_turn(costs: StepCosts, c: int, t_turn) -> np.ndarray:
    """[K] chunk c's time on the CPU queue: ``t_turn`` (its update, or a speculation's check
    and update), or, where its states are on the drive, at least their read and write-back."""
    io = max(costs.t_sread[c], costs.t_swrite[c])
    return np.where(costs.on_drive(c), np.maximum(t_turn, io), t_turn)


def staged_update(costs: StepCosts, q: QueueState, c: int, which: np.ndarray, cpu_free, ready,
                  t_turn) -> tuple[np.ndarray, np.ndarray]:
    """(end, length) of chunk c's turn on the CPU queue for the plans ``which``: ``cpu_free``
    when the CPU could take it, ``ready`` when its gradients are on the host, ``t_turn`` its
    time there without the drive. Counts its states' traffic on the drive."""
    start = np.maximum(cpu_free, ready)
    nv = which & costs.on_drive(c)
    if not nv.any():
        return start + t_turn, t_turn
    start = np.where(nv, np.maximum(start, costs.t_sread[c]), start)
    q.drive_busy += np.where(nv, np.array([[costs.t_sread[c]], [costs.t_swrite[c]]]), 0.0)
    turn = staged_turn(costs, c, t_turn)
    return start + turn, turn


def drive_floor(costs: StepCosts, q: QueueState, iter_time: np.ndarray) -> np.ndarray:
    """``iter_time``, at least the drive's busy time in either direction where a plan keeps
    states on the drive."""
    return np.where(costs.nnvme > 0, np.maximum(iter_time, q.drive_busy.max(axis=0)), iter_time)
