"""The step-time model: predicted iteration time of a plan. Pure, vectorized over plans.

    T_iter = max(T_fwd + T_bwd + T_gpu_optim, end of the last CPU Adam step)

which is ProTrain's T_fwd + max(T_bwd + T_gpu_optim, T_cpu_optim) with the CPU steps placed
where they can start. T_fwd and T_bwd come from a small event simulation of four queues that
run concurrently - device compute, the host-to-device copy engine, the device-to-host copy
engine and the CPU optimizer - in the order the runtime issues work. ``simulate`` runs its
three phases over one ``QueueState`` (``cost.time_queues``), each phase in a module of its own:
forward (``cost.time_forward``: chunk uploads into buffers, activations swapped out), backward
(``cost.time_backward``: re-uploads, recompute, activations prefetched, gradients offloaded to
CPU Adam) and the step's end (``cost.time_step_end``: the updates left for after backward, the
device's Adam, the iteration). What each piece costs per chunk is ``cost.chunk_times``.

SSD blocks (SSDTrain) behave as swapped ones, with the NVMe bandwidth: with GPUDirect Storage
their writes and reads have queues of their own; in compatibility mode they bounce through the
host and occupy the D2H / H2D queues as well. Offloaded chunks whose optimizer states are on
the drive (``n_nvme``) read them before CPU Adam's update and write them back after it, on the
drive's same queues (``cost.time_state_io``).

Copy concurrency (``HardwareProfile.copy_engines``): with one copy engine the two copy queues
are one FIFO; with none (a CPU "device") every copy and every CPU Adam step runs on the
compute timeline where the runtime issues it, so offloading costs its full transfer time -
unless CPU Adam has a thread of its own (``HardwareProfile.cpu_adam_thread``: a CPU "device"
whose runtime runs CPU Adam on its worker thread, on a core of its own).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from ..layout import ChunkLayout
from .time_backward import simulate_backward
from .time_forward import simulate_forward
from .time_queues import QueueState, step_costs
from .time_state_io import drive_time
from .time_step_end import simulate_step_end


@dataclass(frozen=True, slots=True)
class TimePrediction:
    """Seconds; every field is an array with one entry per plan simulated."""

    iter_time: np.ndarray
    fwd_time: np.ndarray
    """End of forward (compute of the post part)."""
    bwd_time: np.ndarray
    """From end of forward to end of backward compute (recompute and copy waits included)."""
    gpu_optim_time: np.ndarray
    """Device Adam over the persistent chunks."""
    cpu_optim_time: np.ndarray
    """CPU Adam busy time over the offloaded chunks (mostly hidden behind backward)."""
    cpu_optim_exposed: np.ndarray
    """Part of the CPU optimizer not hidden: time from the end of the device's work to the end
    of the last CPU Adam step."""
    h2d_bytes: np.ndarray
    d2h_bytes: np.ndarray
    drive_time: np.ndarray | None = None
    """Seconds the drive is busy, both directions together (its busier direction where they
    are independent): activations of SSD blocks and optimizer states of NVMe chunks
    (``cost.time_state_io``)."""
    spec_useful: np.ndarray | None = None
    """With ``speculate_from``: how many of the speculating chunks (from the first one CPU
    Adam reaches) had their backup done before backward's end - the rest would only have
    delayed the updates left for after it (``protrain.search`` chooses the count from it)."""


def simulate(profile: ModelProfile, layout: ChunkLayout, hw: HardwareProfile, n_persist,
             n_buffer, block_modes, *, optimizer_step: bool = True,
             cpu_overlap: bool = True, world: int = 1, speculate_from=None,
             speculation_wrong: bool = False, carry_over: bool = False,
             checks_on_host: bool = False, n_nvme=0, n_shard=0, trace: list | None = None) -> TimePrediction:
    """Simulate K plans at once: n_persist[K], n_buffer[K], block_modes[K, n_blocks] (codes).

    ``optimizer_step=False`` simulates a micro-step that only accumulates gradients (no Adam
    on either side). ``cpu_overlap=False`` starts CPU Adam only once backward is over (the
    global gradient norm or the fp16 overflow check needs every gradient first); then
    ``speculate_from[K]`` (a chunk index per plan) lets chunks from that index on update
    speculatively during backward, each first backing up its states (``chunk_times.backup_times``);
    ``speculation_wrong``: the step clips (or overflows), so after backward every speculated
    chunk is restored from its backup and updated again, in the order of the others.
    ``checks_on_host``: the step's verdict inputs (each offloaded chunk's gradient norms for
    clipping, its overflow test) are taken on the host as its gradients land, on the CPU
    queue (accumulated gradients); else on the device before they leave it, where they are
    bandwidth-bound reads left out of the model - except on a CPU "device", where they sit on
    the compute timeline. Both only without ``cpu_overlap`` (clipping / fp16).
    ``carry_over``: CPU Adam left at the end of the step runs on into the next forward (the
    runtime's behaviour), which waits only where an offloaded chunk's upload needs its update:
    the iteration is the device's work plus that wait, and at least the CPU's busy time. The
    search ranks plans without it (its lower bounds assume CPU Adam ends within the step);
    the chosen plan's prediction includes it.
    ``n_nvme[K]``: the last chunks whose optimizer states are on the drive; CPU Adam streams
    them through the staging ring (``cost.time_state_io``). ``n_shard[K]``: of the ``n_persist``
    chunks, the last ones sharded over the ranks (gathered into the buffers over the
    collectives, device Adam on this rank's shard).

    ``trace`` (one plan): receives (lane, what, label, start, end) for every simulated piece of
    work (protrain/timeline.py draws them)."""
    costs = step_costs(profile, layout, hw, n_persist, n_buffer, block_modes,
                       optimizer_step=optimizer_step, cpu_overlap=cpu_overlap, world=world,
                       speculate_from=speculate_from, speculation_wrong=speculation_wrong,
                       carry_over=carry_over, checks_on_host=checks_on_host, n_nvme=n_nvme,
                       n_shard=n_shard)
    q = QueueState.idle(costs, trace)
    fwd_end = simulate_forward(costs, q)
    bwd_end = simulate_backward(costs, q)
    end = simulate_step_end(costs, q, bwd_end)
    return TimePrediction(
        iter_time=end.iter_time, fwd_time=fwd_end, bwd_time=bwd_end - fwd_end,
        gpu_optim_time=end.gpu_optim_time, cpu_optim_time=q.cpu_busy,
        cpu_optim_exposed=end.cpu_optim_exposed,
        h2d_bytes=q.h2d_bytes, d2h_bytes=q.d2h_bytes, drive_time=drive_time(costs, q),
        spec_useful=(q.spec_ready < bwd_end[None, :]).sum(axis=0) if q.spec_ready is not None else None)
