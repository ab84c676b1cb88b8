"""HardwareProfile: the machine figures the cost models need, measured or published.

Measured by ``protrain.measure.probe.probe_hardware`` (cached on disk), or taken from a named
machine in ``protrain.profile.machines`` for planning before a GPU is rented.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from ..serde import JsonValue
from ..units import fmt_bytes


@dataclass(frozen=True, slots=True)
class HardwareProfile(JsonValue):
    """One device (the one a rank trains on) and its host."""

    name: str
    """Device name as the driver reports it (``NVIDIA H100 80GB HBM3``) or the machine preset."""
    source: Literal["measured", "published"]
    """``measured`` by the probe on this machine, or ``published`` peak figures (an estimate)."""
    device_type: str
    """``cuda`` or ``cpu`` (on CPU the "device" is the CPU itself, for tests)."""
    device_memory: int
    """Bytes of device memory the framework can allocate (total less what the CUDA context and
    other processes hold)."""
    host_memory: int
    """Bytes of the node's host memory available for pinned model states and swapped
    activations; each of its ``ranks_per_node`` ranks plans for its share
    (``cost.host_share.host_memory_share``)."""
    h2d_bandwidth: float
    """Host-to-device copy bandwidth from pinned memory, bytes/s."""
    d2h_bandwidth: float
    """Device-to-host copy bandwidth into pinned memory, bytes/s."""
    gpu_adam_rate: float
    """Parameters per second updated by the device's fused Adam (fp32 master, m, v)."""
    cpu_adam_rate: float
    """Parameters per second updated by DeepSpeedCPUAdam on the host, all cores (with the
    runtime's passes around it where ``cpu_adam_kernel_rate`` is set)."""
    collective_bandwidth: float = 0.0
    """Per-rank bandwidth of all-gather / reduce-scatter between data-parallel ranks, bytes/s
    (time = bytes * (world - 1) / world / bandwidth). 0 when unknown (one rank)."""
    alltoall_bandwidth: float = 0.0
    """Per-rank all-to-all bandwidth between the ranks of a sequence-parallel group, bytes/s
    (time = bytes * (P - 1) / P / bandwidth, the convention of collective_bandwidth). 0:
    unknown; the planner then uses collective_bandwidth."""
    host_copy_bandwidth: float = 0.0
    """Bytes/s of a host-memory copy between fp32 tensors (what a speculative CPU Adam update
    costs to back up master, exp_avg and exp_avg_sq, where the runtime copies them before the
    update: DeepSpeed's kernel). 0: not measured; the planner then assumes the backup takes as
    long as the update itself (a measured CPU ratio)."""
    backup_bandwidth: float = 0.0
    """Bytes/s of that backup (12 bytes per parameter) where the native kernel takes it in the
    update's own pass (csrc/cpu_adam.cpp: streamed stores beside the update, which reads the
    states anyway): the kernel's time with the backup less its time without, measured by the
    probe with the kernel the runtime uses (on this project's 2-core VM about twice the rate
    ``host_copy_bandwidth`` gives a separate copy). 0: not measured, or the runtime's kernel
    copies first; the backup is then priced at ``host_copy_bandwidth``."""
    copy_engines: int = 2
    """Copy engines that run next to compute: 2 (one per direction, data-center GPUs), 1 (both
    directions share one queue), 0 (none: every copy, and the CPU optimizer, runs on the
    compute timeline - a CPU "device", where the runtime copies synchronously and runs CPU
    Adam inline, since they would compete for the same cores)."""
    grad_check_rate: float = 0.0
    """Gradient elements per second the host checks for the step's verdict (a parameter's norm
    for clipping, the overflow test for fp16), measured as an fp32 norm. 0: not measured; the
    planner then assumes cost.chunk_times.CHECK_PER_ADAM times the CPU Adam rate."""
    host_pass_rate: float = 0.0
    """fp32 elements per second of one in-place pass over host memory (gradients scaled by a
    clipping coefficient, or zeroed): what the runtime's update of an offloaded chunk adds
    around the Adam kernel (``cost.host_update``). 0: not measured; not priced then."""
    host_update_overhead: float = 0.0
    """Seconds of the runtime's own work per offloaded chunk update beyond the work per
    parameter (its bookkeeping in Python, the kernel call, the reset; ``measure.update_overhead``):
    added to every offloaded chunk's CPU Adam time. 0: not measured (published machines)."""
    step_dispatch_overhead: float = 0.0
    """Seconds per offloaded chunk that ``step()`` spends on the training thread deciding and
    queuing the updates left for the step's verdict (clipping or fp16, no chunk speculating),
    where they run on a worker thread beside compute (``measure.update_overhead``): the next
    forward starts after it, and the runtime counts it as exposed CPU Adam. Inline (a CPU
    "device" without its worker) it is part of ``host_update_overhead``. 0: not measured
    (published machines)."""
    cpu_adam_kernel_rate: float = 0.0
    """When ``cpu_adam_rate`` is the runtime's whole update (the kernel and the passes around
    it, ``cost.host_update.runtime_update_rate``): the kernel's own rate. 0: it is the
    kernel's."""
    cpu_adam_thread: bool = False
    """Without copy engines: CPU Adam runs on a thread (and core) of its own next to compute
    anyway - a CPU "device" whose runtime uses its worker thread (``"host_thread": true``);
    copies stay on the compute timeline. With copy engines CPU Adam always has its own."""
    nvme_write_bandwidth: float = 0.0
    """Write bandwidth of the SSD path for activations, bytes/s (0: no SSD tier)."""
    nvme_read_bandwidth: float = 0.0
    """Read bandwidth of the SSD path, bytes/s."""
    nvme_gds: bool = False
    """GPUDirect Storage: NVMe traffic bypasses host memory and does not share PCIe queues
    with chunk traffic (compatibility mode and POSIX bounce through the host and do)."""
    nvme_duplex: bool = False
    """The drive read and wrote at about their own bandwidths at once in the probe
    (``measure.probe.probe_storage``): the step-time model gives reads and writes a queue
    each. False (published machines, or not measured): they share the drive's time, as a
    drive's flash usually makes them."""
    nvme_free_bytes: int = 0
    """Free space on the SSD path."""
    nvme_held_bytes: int = 0
    """Of the space not free on the SSD path, bytes this rank's own state file holds while a
    re-plan moves its states into the new plan's file (free again once they are there; the
    re-plan needs room for both). 0: no re-plan, or no states on the drive."""
    peak_flops: float = 0.0
    """Dense bf16 tensor FLOP/s (published), used only by the analytic profile."""
    cpu_cores: int = 1
    """Host cores (logical) the probe measured the host rates with: all those the node's
    ranks run on (``runtime.node.node_cores``)."""
    ranks_per_node: int = 1
    """Ranks sharing this host (``runtime.node``; ``protrain plan --ranks-per-node``). The
    host rates above are the node's, measured by one process with all its cores; each rank
    is priced at 1/ranks_per_node of them (``cost.host_share``)."""
    versions: dict[str, str] = field(default_factory=dict)
    """Software versions the measurement was taken with (torch, cuda, deepspeed)."""

    def with_limits(self, *, device_memory: int | None = None,
                    host_memory: int | None = None) -> "HardwareProfile":
        """The same machine with the plan's memory budgets set to the given limits."""
        return replace(self, device_memory=device_memory or self.device_memory,
                       host_memory=host_memory or self.host_memory)

    def describe(self) -> str:
        return (f"{self.name} ({self.source}): device {fmt_bytes(self.device_memory)}, host "
                f"{fmt_bytes(self.host_memory)}, H2D {self.h2d_bandwidth / 1e9:.1f} GB/s, D2H "
                f"{self.d2h_bandwidth / 1e9:.1f} GB/s, device Adam {self.gpu_adam_rate / 1e9:.2f} "
                f"Gparam/s, CPU Adam {self.cpu_adam_rate / 1e9:.2f} Gparam/s"
                + (f" (kernel {self.cpu_adam_kernel_rate / 1e9:.2f}, with the runtime's passes "
                   f"around it)" if self.cpu_adam_kernel_rate else "")
                + (f" + {self.host_update_overhead * 1e6:.0f} us per chunk update"
                   if self.host_update_overhead else "")
                + (f", step() {self.step_dispatch_overhead * 1e6:.0f} us per chunk it queues after "
                   f"the verdict" if self.step_dispatch_overhead else "")
                + (f", host copy {self.host_copy_bandwidth / 1e9:.0f} GB/s" if self.host_copy_bandwidth else "")
                + (f", backup in the update {self.backup_bandwidth / 1e9:.0f} GB/s" if self.backup_bandwidth else "")
                + (f"; host shared by {self.ranks_per_node} ranks per node: CPU Adam "
                   f"{self.cpu_adam_rate / self.ranks_per_node / 1e9:.3f} Gparam/s per rank"
                   if self.ranks_per_node > 1 else ""))

