"""What one rank gets of its host: the host rates a rank is priced at when several share a node.

``HardwareProfile`` holds the node's figures, measured by one process with all the node's cores
while the node's other ranks wait (``measure.probe``), and ``ranks_per_node``. When the ranks
run host work at once - and data-parallel ranks in step do: each updates its shard of the same
chunk as the same gradients land - each gets about 1/ranks_per_node of it:

- CPU Adam and the passes around it (``cost.host_update``), the gradient checks and the
  speculative backup copies are memory-bound streams: the node's memory bandwidth is split
  among the ranks. Where a kernel is compute-bound instead, the cores are split (each rank's
  kernel runs on cores // ranks_per_node threads, ``runtime.node.NodeShare.threads``). Either
  way a rank gets node rate / ranks_per_node. Measured on a 2-core VM: DeepSpeed's kernel 1.97
  G parameters/s with 2 threads alone; 2 processes with a thread each at once, 0.90-1.08 each
  (one alone: 1.6, so a rank's share measured alone would be 60% optimistic).
- The per-chunk update overhead (``HardwareProfile.host_update_overhead``) is Python on one
  core and an OpenMP fork and join: a rank runs it on a core of its own while the ranks do not
  outnumber the cores, so it is not divided; beyond that they time-share the cores. It does
  not stream memory, so it hides under the other ranks' streams (``chunk_times.cpu_adam_times``).
- Host-device copies (``h2d_bandwidth``, ``d2h_bandwidth``) go over each GPU's own PCIe link:
  not shared. The host memory they read and write is, but on current 8-GPU servers its
  bandwidth is several times what the GPUs' links move together; GPUs behind one PCIe switch
  do share its uplink, which this model leaves out. On a CPU "device" (tests) every "copy" and
  the "device" Adam are host memory work, shared like CPU Adam.
- Collective bandwidths are measured with every rank taking part: already shared.
- The drive under ``ssd_path`` (``nvme_*`` figures, measured by one process: ``measure.probe``)
  is assumed to be one per node - one filesystem, however many devices behind it - that the
  node's ranks all write their activations (``n_ssd``) and optimizer states (``n_nvme``) to:
  each rank gets 1/ranks_per_node of its bandwidth, and of its free space (``nvme_free_share``).
  A node with a drive per rank is described by ``ranks_per_node`` drives' worth of figures.

Pure: a function of the profile alone, so the same profile gives the same prediction.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..profile.hardware import HardwareProfile


@dataclass(frozen=True, slots=True)
class RankRates:
    """One rank's host figures (parameters, elements or bytes per second; seconds)."""

    cpu_adam: float
    """Parameters/s of the rank's CPU Adam update (with the runtime's passes where
    ``HardwareProfile.cpu_adam_kernel_rate`` says they are included)."""
    grad_check: float
    """Gradient elements/s of the host's verdict check (0: not measured)."""
    host_copy: float
    """Bytes/s of a host-memory copy (0: not measured)."""
    backup: float
    """Bytes/s of a speculative update's backup taken in the kernel's pass (0: it is a copy)."""
    update_overhead: float
    """Seconds of the runtime's own work per offloaded chunk update."""
    step_dispatch: float
    """Seconds of step()'s work on the training thread per update it queues after the verdict."""
    h2d: float
    d2h: float
    device_adam: float
    """Parameters/s of the "device" Adam over persistent chunks."""
    nvme_read: float = 0.0
    nvme_write: float = 0.0
    """Bytes/s of the rank's share of the drive (0: no drive)."""


def rank_rates(hw: HardwareProfile) -> RankRates:
    """The figures one of ``hw.ranks_per_node`` ranks is priced at."""
    r = max(1, hw.ranks_per_node)
    on_host = hw.device_type == "cpu"          # the "device" is the host: its work is shared too
    return RankRates(
        cpu_adam=hw.cpu_adam_rate / r, grad_check=hw.grad_check_rate / r,
        host_copy=hw.host_copy_bandwidth / r, backup=hw.backup_bandwidth / r,
        update_overhead=hw.host_update_overhead * max(1.0, r / max(1, hw.cpu_cores)),
        step_dispatch=hw.step_dispatch_overhead * max(1.0, r / max(1, hw.cpu_cores)),
        h2d=hw.h2d_bandwidth / r if on_host else hw.h2d_bandwidth,
        d2h=hw.d2h_bandwidth / r if on_host else hw.d2h_bandwidth,
        device_adam=hw.gpu_adam_rate / r if on_host else hw.gpu_adam_rate,
        nvme_read=hw.nvme_read_bandwidth / r, nvme_write=hw.nvme_write_bandwidth / r)


def nvme_free_share(hw: HardwareProfile) -> float:
    """Bytes of the drive's free space one of the node's ranks may fill."""
    return hw.nvme_free_bytes / max(1, hw.ranks_per_node)


def host_memory_share(hw: HardwareProfile) -> int:
    """Host bytes one of the node's ranks may plan for: ``hw.host_memory`` is the node's
    (``protrain plan --host-memory``, ``protrain.host_memory``), and its ranks' states and
    swapped activations share it."""
    return hw.host_memory // max(1, hw.ranks_per_node)
