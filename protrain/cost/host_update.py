"""The CPU work of one offloaded parameter's update, beyond the Adam kernel.

The probe measures the kernel alone (``HardwareProfile.cpu_adam_rate``), but the runtime's
update of an offloaded chunk (runtime/optimizer.py ``_update``, ``_host_update``,
``_reset_chunk``) makes more passes over host memory around it, each memory-bound like the
kernel, depending on the kernel and the training setup:

- DeepSpeed's kernel takes fp32 gradients as they are: 16-bit gradients are first widened
  into an fp32 temporary (a copy), and a clipping coefficient or an inverse loss scale is
  applied in place first (a pass). The native kernel (csrc/cpu_adam.cpp) does both tile by
  tile inside its own pass.
- With 16-bit parameters the updated fp32 master is copied into the pinned 16-bit region the
  next upload reads (a copy).
- With gradient accumulation the fp32 accumulator is zeroed for the next step (a pass).
  Without it nothing is: the next backward's copy overwrites the gradient region whole (fp32
  training), or the gradients land in the 16-bit upload region, which the copy above
  overwrites.

On this project's 2-core CPU, fp32 with clipping: the kernel alone 36.7 ms for 26.3 M
parameters, the scale pass 8.6 ms, a zeroing pass (made then, dropped since) 8.5 ms - together
the 53 ms the engine measured after backward, where the kernel alone predicted 32 ms.
``runtime_update_rate`` folds the passes into the rate the cost model prices CPU Adam at; the
runtime's own time per chunk is priced apart (``HardwareProfile.host_update_overhead``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..profile.hardware import HardwareProfile


@dataclass(frozen=True, slots=True)
class HostUpdatePasses:
    """Passes over host memory per offloaded parameter and update, beyond the kernel."""

    in_place: int
    """fp32 passes in place (gradients scaled, an accumulator zeroed)."""
    copies: int
    """Copies from one region into another (16-bit gradients widened, the updated
    parameters written into the 16-bit upload region)."""


def host_update_passes(*, fused_kernel: bool, half: bool, grad_accumulation: bool,
                       scaled: bool) -> HostUpdatePasses:
    """The runtime's passes around the kernel. ``fused_kernel``: the native kernel (widens and
    scales in its own pass); ``half``: 16-bit parameters; ``scaled``: clipping or fp16 loss
    scaling (a coefficient applied to every gradient)."""
    in_place = int(scaled and not fused_kernel) + int(grad_accumulation)
    copies = int(half and not fused_kernel) + int(half)
    return HostUpdatePasses(in_place=in_place, copies=copies)


def runtime_update_rate(hw: HardwareProfile, passes: HostUpdatePasses) -> HardwareProfile:
    """``hw`` with ``cpu_adam_rate`` the parameters/s of the runtime's whole update (the kernel
    and ``passes``), the kernel's own rate kept in ``cpu_adam_kernel_rate``. Unchanged where
    the pass rates were not measured (published machines)."""
    if hw.cpu_adam_kernel_rate > 0:
        raise ValueError("runtime_update_rate: the passes are already in cpu_adam_rate")
    if passes == HostUpdatePasses(0, 0) or min(hw.host_pass_rate, hw.host_copy_bandwidth,
                                               hw.cpu_adam_rate) <= 0:
        return hw
    per_param = (1.0 / hw.cpu_adam_rate + passes.in_place / hw.host_pass_rate
                 + passes.copies * 4.0 / hw.host_copy_bandwidth)
    return replace(hw, cpu_adam_rate=1.0 / per_param, cpu_adam_kernel_rate=hw.cpu_adam_rate)


def backup_as_run(hw: HardwareProfile, *, native: bool, speculates: bool,
                  params: int = 2**24) -> HardwareProfile:
    """``hw`` with the speculative update's backup priced as the runtime takes it: in the
    native kernel's pass (``backup_bandwidth``; measured here where the probe did not, for a
    CPU "device" asked for that kernel, and only where a step may speculate - clipping or fp16),
    or as a copy before DeepSpeed's kernel (``host_copy_bandwidth``: the figure cleared)."""
    if not native:
        return replace(hw, backup_bandwidth=0.0) if hw.backup_bandwidth else hw
    if hw.backup_bandwidth or not speculates:
        return hw
    from ..measure.probe import fused_backup_bandwidth
    from ..runtime.host_threads import omp_threads
    with omp_threads(hw.cpu_cores):      # the node's threads, as the probe measured the kernel
        return replace(hw, backup_bandwidth=fused_backup_bandwidth(params, threads=hw.cpu_cores))

