"""Named machines: published peak figures, for planning before the hardware is at hand.

These are vendor datasheet numbers scaled by stated efficiencies, not measurements: the plan
they give is an estimate. ``protrain probe`` measures the real machine; at run time the
measured profile is always used.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..units import GiB
from .hardware import HardwareProfile

PCIE_EFFICIENCY = 0.8
"""Share of the PCIe link rate a pinned cudaMemcpy reaches (typical; measure with probe)."""
HBM_EFFICIENCY = 0.7
"""Share of the HBM bandwidth a fused Adam kernel reaches."""
ADAM_BYTES_PER_PARAM = 28
"""Bytes a fused mixed-precision Adam moves per parameter: fp32 master, m, v read and written
(24), the 16-bit gradient read and the 16-bit parameter written (4)."""
CONTEXT_RESERVE = 1 * GiB
"""Device memory the CUDA context, cuBLAS workspaces and NCCL take outside torch's allocator."""
DEFAULT_CPU_ADAM_RATE = 1.0e9
"""Assumed DeepSpeedCPUAdam throughput (parameters/s) of a server host; measure yours with
``protrain probe``."""
DEFAULT_HOST_MEMORY = 128 * GiB
DEFAULT_HOST_COPY_BANDWIDTH = 50e9
"""Assumed bytes/s of a host-to-host copy (``copy_`` between fp32 tensors: a speculative
update's backup of master, exp_avg and exp_avg_sq) on a server host - a few threads' streaming
copy, about a quarter of one socket's DDR5 bandwidth; measure yours with ``protrain probe``.
Without it a backup was priced as long as the update itself (the ratio on this project's 2-core
VM, whose copies run at 10-16 GB/s beside 1.3-1.7 Gparam/s of CPU Adam), which kept the
published plans from speculating where a server's backups are cheap (issue 37 item 1)."""


@dataclass(frozen=True)
class Machine:
    name: str
    device_memory: int        # bytes as torch reports total_memory
    bf16_flops: float         # dense tensor-core FLOP/s
    hbm_bandwidth: float      # bytes/s
    pcie_bandwidth: float     # bytes/s per direction (link rate)
    collective_bandwidth: float = 0.0   # achievable all-gather bus bandwidth between GPUs

    def profile(self, *, host_memory: int = DEFAULT_HOST_MEMORY,
                cpu_adam_rate: float = DEFAULT_CPU_ADAM_RATE, cpu_cores: int = 64,
                host_copy_bandwidth: float = DEFAULT_HOST_COPY_BANDWIDTH) -> HardwareProfile:
        return HardwareProfile(
            name=self.name, source="published", device_type="cuda",
            device_memory=self.device_memory - CONTEXT_RESERVE, host_memory=host_memory,
            h2d_bandwidth=self.pcie_bandwidth * PCIE_EFFICIENCY,
            d2h_bandwidth=self.pcie_bandwidth * PCIE_EFFICIENCY,
            gpu_adam_rate=self.hbm_bandwidth * HBM_EFFICIENCY / ADAM_BYTES_PER_PARAM,
            cpu_adam_rate=cpu_adam_rate, peak_flops=self.bf16_flops, cpu_cores=cpu_cores,
            collective_bandwidth=self.collective_bandwidth, host_copy_bandwidth=host_copy_bandwidth)


_GEN3, _GEN4, _GEN5 = 16e9, 32e9, 64e9
MACHINES: dict[str, Machine] = {m.name: m for m in [
    # Collective bandwidth: NVLink at ~80% of the per-direction link rate (SXM parts);
    # PCIe-only parts share the PCIe link.
    Machine("h100-80gb", int(79.2 * GiB), 989e12, 3.35e12, _GEN5, 360e9),   # SXM5, NVLink 4
    Machine("h100-pcie-80gb", int(79.2 * GiB), 756e12, 2.0e12, _GEN5, 0.8 * _GEN5),
    Machine("h200", int(139.8 * GiB), 989e12, 4.8e12, _GEN5, 360e9),
    Machine("a100-80gb", int(79.2 * GiB), 312e12, 2.04e12, _GEN4, 240e9),   # SXM4, NVLink 3
    Machine("a100-40gb", int(39.4 * GiB), 312e12, 1.56e12, _GEN4, 240e9),
    Machine("l40s", int(44.4 * GiB), 362e12, 0.864e12, _GEN4, 0.8 * _GEN4),
    Machine("rtx3090", int(23.7 * GiB), 71e12, 0.936e12, _GEN3, 0.8 * _GEN3),  # PCIe 3, as in the paper
]}


def machine(name: str) -> Machine:
    try:
        return MACHINES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown machine {name!r}; known: {', '.join(MACHINES)} "
                         f"(or measure this one with `protrain probe`)") from None


_DEVICE_NAMES = (("H200", "h200"), ("H100 PCIe", "h100-pcie-80gb"), ("H100", "h100-80gb"),
                 ("A100-SXM4-40GB", "a100-40gb"), ("A100-SXM4-80GB", "a100-80gb"),
                 ("A100-SXM-80GB", "a100-80gb"), ("L40S", "l40s"), ("RTX 3090", "rtx3090"))
"""Substrings of ``torch.cuda.get_device_name`` and the machine they name, most specific first
(PCIe A100s are left out: their link figure differs from the SXM parts' NVLink)."""


def machine_for_device(device_name: str) -> Machine | None:
    """The named machine of a CUDA device name (e.g. "NVIDIA H100 80GB HBM3"), None if unknown."""
    for part, name in _DEVICE_NAMES:
        if part.lower() in device_name.lower():
            return MACHINES[name]
    return None
