"""What each chunk's pieces of work cost at one rank's rates: its upload, its gradient offload,
its CPU Adam update, its share of the step's verdict check, its backup before a speculative
update, and the all-reduce of the persistent chunks. The time model (``cost.time_model``)
places these on its queues; the search's lower bounds add them up directly."""
from __future__ import annotations

import numpy as np

from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from .host_share import rank_rates
from ..layout import ChunkLayout
from ..state_tier import staged_bytes_per_element, state_bytes_per_element


def chunk_transfer_times(layout: ChunkLayout, profile: ModelProfile, hw: HardwareProfile,
                         world: int = 1):
    """Per-chunk upload time, gradient offload time and CPU Adam time (seconds; the runtime's
    own time per update, ``hw.host_update_overhead``, included), at the rates one of the
    node's ``hw.ranks_per_node`` ranks gets (``cost.host_share``).

    With ``world`` data-parallel ranks an offloaded chunk is sharded: an upload is the H2D
    copy of this rank's 1/world shard followed by an all-gather of the rest; a gradient
    offload is a reduce-scatter followed by the D2H copy of the shard; CPU Adam updates the
    shard only."""
    rr = rank_rates(hw)
    used = np.asarray(layout.used, dtype=np.float64)
    nbytes = used * profile.param_bytes
    up, down = nbytes / world / rr.h2d, nbytes / world / rr.d2h
    adam = cpu_adam_times(used / world, hw)
    if world > 1:
        coll = nbytes * (world - 1) / world / _collective_bandwidth(hw)
        up, down = up + coll, down + coll
    return up, down, adam


def cpu_adam_times(shard, hw: HardwareProfile):
    """Seconds of one rank's CPU Adam update of offloaded shards of ``shard`` parameters each,
    the runtime's own time per update included, while the node's ``hw.ranks_per_node`` ranks
    update theirs at once.

    The update streams memory; the runtime's own time per update (Python bookkeeping, an OpenMP
    fork and join: ``update_overhead``) does not, and while one rank spends it the others'
    streams have the node's memory to themselves. So a rank's update takes the longer of its
    share of the node's streaming (``shard`` at ``cpu_adam``: node rate / ranks per node) and
    its own path: its stream at the node's rate plus its own time. With one rank per node that
    is the stream plus its own time, as before. Measured with 2 gloo ranks on the 2-core VM
    (bench/cpu_adam_ranks.py, quiet, 8 rounds): adding the own time to the shared streaming
    made the prediction a median 29-31% slower than measured; the ranks' own times hide under
    each other's streams."""
    rr = rank_rates(hw)
    shard = np.asarray(shard, dtype=np.float64)
    own = np.where(shard > 0, rr.update_overhead, 0.0)
    if max(1, hw.ranks_per_node) <= 1 or hw.cpu_adam_rate <= 0:
        return shard / rr.cpu_adam + own
    return np.maximum(shard / rr.cpu_adam, shard / hw.cpu_adam_rate + own)


def state_io_times(layout: ChunkLayout, hw: HardwareProfile, world: int, master_separate: bool,
                   speculative: bool = False):
    """[chunks] seconds to read an NVMe chunk's states (of this rank's shard) from the drive
    into a staging buffer, and to write them back (in fp32 with speculation, with the master
    from before the update: ``state_tier.staged_bytes_per_element``), at this rank's share of
    the drive (``cost.host_share``); zeros without a drive."""
    shard = -(-np.asarray(layout.used, dtype=np.int64) // world).astype(np.float64)
    rr = rank_rates(hw)
    if rr.nvme_read <= 0 or rr.nvme_write <= 0:
        return np.zeros_like(shard), np.zeros_like(shard)
    return (shard * state_bytes_per_element(master_separate) / rr.nvme_read,
            shard * staged_bytes_per_element(master_separate, speculative) / rr.nvme_write)


def allreduce_times(layout: ChunkLayout, hw: HardwareProfile, world: int) -> np.ndarray:
    """[chunks] seconds of a persistent chunk's fp32 gradient all-reduce at the accumulation
    boundary (ring: 2 (world - 1) / world of the bytes each way); zeros on one rank. The
    runtime starts it as the chunk's backward ends, on the collectives' own queue."""
    used = np.asarray(layout.used, dtype=np.float64)
    if world <= 1:
        return np.zeros_like(used)
    return used * 4 * 2 * (world - 1) / world / _collective_bandwidth(hw)


def gather_times(layout: ChunkLayout, profile: ModelProfile, hw: HardwareProfile, world: int) -> np.ndarray:
    """[chunks] seconds of a sharded persistent chunk's all-gather into its buffer (before
    use) and of its gradients' reduce-scatter (after its backward): (world - 1) / world of the
    chunk's bytes in the training dtype at the collective bandwidth, on the upload and the
    offload queue (the runtime issues them there, after the shard's device copy, whose time at
    device-memory bandwidth is left out); zeros on one rank."""
    used = np.asarray(layout.used, dtype=np.float64)
    if world <= 1:
        return np.zeros_like(used)
    return used * profile.param_bytes * (world - 1) / world / _collective_bandwidth(hw)


def device_adam_elements(layout: ChunkLayout, n_persist, n_shard, world: int):
    """Elements device Adam updates at the step: every element of the replicated persistent
    chunks, this rank's shard of the ``n_shard`` sharded ones (the last of the ``n_persist``)."""
    used = np.asarray(layout.used, dtype=np.int64)
    prefix = np.concatenate([[0], np.cumsum(used)])
    shard = np.concatenate([[0], np.cumsum(-(-used // world))])
    n_persist = np.asarray(n_persist)
    rep = n_persist - np.asarray(n_shard)
    return prefix[rep] + shard[n_persist] - shard[rep]


def device_optimizer_floor(layout: ChunkLayout, hw: HardwareProfile, world: int, n_persist, n_shard=0):
    """The least the device's optimizer adds after backward: device Adam over its elements
    (``device_adam_elements``) and the replicated chunks' all-reduces that cannot start
    before backward's end (``allreduce_after_backward``)."""
    rr = rank_rates(hw)
    rep = np.asarray(n_persist) - np.asarray(n_shard)
    return (device_adam_elements(layout, n_persist, n_shard, world) / rr.device_adam
            + allreduce_after_backward(layout, rep, hw, world))


def allreduce_after_backward(layout: ChunkLayout, n_persist, hw: HardwareProfile, world: int):
    """Seconds of the persistent chunks' all-reduces that cannot start before backward's last
    compute: those of the chunks first used by the first part (the embedding's; their
    backward is the last), the least the step's end waits for them - a lower bound for the
    search (``search.bounds``)."""
    at_end = int(np.searchsorted(np.asarray(layout.chunk_first_part), 1))
    prefix = np.concatenate([[0], np.cumsum(allreduce_times(layout, hw, world))])
    return prefix[np.minimum(np.asarray(n_persist), at_end)]


def _collective_bandwidth(hw: HardwareProfile) -> float:
    if hw.collective_bandwidth <= 0:
        raise ValueError(f"{hw.name}: planning for several data-parallel ranks needs the collective "
                         f"bandwidth; probe the machine with the ranks launched, or use a named GPU")
    return hw.collective_bandwidth


def check_times(layout: ChunkLayout, hw: HardwareProfile, world: int = 1):
    """Per-chunk time to take a chunk's part of the step's verdict on the host (its parameters'
    gradient norms for clipping, or the overflow test) as its gradients land."""
    rr = rank_rates(hw)
    rate = rr.grad_check if rr.grad_check > 0 else CHECK_PER_ADAM * rr.cpu_adam
    return np.asarray(layout.used, dtype=np.float64) / world / rate


CHECK_PER_ADAM = 1.7
"""Gradient elements checked per CPU Adam update, where the check rate was not measured
(published machines): an fp32 norm against DeepSpeedCPUAdam on this project's 2-core CPU,
2.9 G elements/s against 1.7 G parameters/s (both memory-bound: a check reads 4 bytes per
element, an update reads and writes 28)."""


def backup_times(layout: ChunkLayout, hw: HardwareProfile, t_adam, world: int = 1):
    """Per-chunk time to back up master, exp_avg and exp_avg_sq (12 bytes per parameter of
    this rank's shard) in a speculative update: at the rate of the kernel's own pass where it
    takes the backup (``HardwareProfile.backup_bandwidth``), else of a host copy; without
    either, as long as the update (the ratio measured on a 2-core CPU: bench/cpu_adam.py)."""
    rr = rank_rates(hw)
    rate = rr.backup or rr.host_copy
    if rate > 0:
        return np.asarray(layout.used, dtype=np.float64) * 12 / world / rate
    return np.asarray(t_adam, dtype=np.float64)
