"""Where the checkpointed blocks keep their inputs (``Knobs.ckpt_input``): an outer loop around
the inner search.

A checkpointed block keeps only its input for backward; at long sequences those inputs add up
(Llama-3 8B at 256K tokens: 32 blocks x 2 GiB). ``"host"`` moves them to pinned host memory
(BlockMode.CKPT_HOST: copied off on the offload queue in forward, fetched back one block ahead
of the block's backward), as Hugging Face's ``gradient_checkpointing_kwargs={"offload": True}``
and ALST do by hand; ``"drive"`` writes them to the NVMe path (BlockMode.CKPT_SSD, SSDTrain's
storage backends) where one is configured and host memory is short (``_host_binds``). It changes which block layouts exist, not the
profile, so the inner search (loop.py) runs once per value, with the value pinned. The inputs
stay on the device unless moving them gives a plan faster beyond the cost model's error band
(moving them costs copy time and host memory or drive bandwidth the other knobs could use);
each moved variant is searched only below the step it must beat (``loop.search``'s ``beat``),
so a variant that cannot win costs little: its floor (``space.search_floor``) or its points'
bounds (``search.pairs``) rule it out before its points are fitted. Values are compared by their
fastest plans (``Plan.fastest``: ``tiles.choose`` says why). A pin fixes the value.
"""
from __future__ import annotations

from dataclasses import replace

from ..block_mode import CKPT_INPUTS
from ..config import PlannerConfig
from ..plan import Plan
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from ..units import fmt_bytes, fmt_seconds
from .infeasible import InfeasibleError
from .loop import search as search_one


def input_candidates(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig) -> tuple[str, ...]:
    """The values the loop plans: the pin (checked), or every place the inputs can go where a
    block may be checkpointed: the device, host memory, and the drive where there is one."""
    drive = hw.nvme_write_bandwidth > 0 and hw.nvme_read_bandwidth > 0
    pin = config.pins.ckpt_input
    if pin is not None:
        if pin == "drive" and not drive:
            raise InfeasibleError(
                "ckpt_input = \"drive\" puts the checkpointed blocks' inputs on the drive, and no drive "
                "is configured: set ssd_path (protrain.ssd_path; protrain plan --nvme GB/s), or pin "
                "ckpt_input to \"host\" or \"device\"")
        return (pin,)
    if not profile.n_blocks or config.pins.n_checkpoint == 0 or profile.inplace_blocks:
        return ("device",)
    if config.model_states_fixed is not None:
        # The Megatron adapter (the framework keeps the model states): its layers run
        # Megatron's recompute or ProTrain's hooks without these modes (refused there as a pin).
        return ("device",)
    return CKPT_INPUTS if drive else ("device", "host")


def search(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig | None = None, *,
           beat: float = float("inf")) -> Plan | None:
    """The fastest plan for ``profile`` on ``hw`` within ``config``'s budgets and pins, over
    where the checkpointed blocks keep their inputs. Raises InfeasibleError (with what would
    fit) when nothing does. ``beat``: an outer loop's incumbent (loop.search's): None when no
    plan is faster."""
    config = config or PlannerConfig()
    values = input_candidates(profile, hw, config)
    pinned = config.pins.ckpt_input is not None
    plans: dict[str, Plan] = {}
    failures: dict[str, InfeasibleError] = {}
    slower: dict[str, float] = {}
    for v in values:
        if v == "drive" and not pinned and not _host_binds(plans, failures):
            continue
        inner = replace(config, pins=replace(config.pins, ckpt_input=v))
        try:
            found = search_one(profile, hw, inner, beat=min(beat, _to_beat(v, plans, config.time_tolerance)))
        except InfeasibleError as e:
            failures[v] = e
            continue
        if found is None:
            slower[v] = min(beat, _to_beat(v, plans, config.time_tolerance))
        else:
            plans[v] = found
        if v == "device" and found is not None and not may_gain(found):
            break
    if not plans and slower:
        return None     # nothing beat the outer loop's incumbent
    if not plans:       # (a pruned search had a plan to beat: every value failed here)
        # The failure that needs the least device memory names the closest plan (its estimates
        # of what would fit reach furthest); one without a device figure (the host binds) last.
        raise min(failures.values(), key=lambda e: (e.device_needed is None, e.device_needed or 0))
    chosen = choose_input(plans, config.time_tolerance)
    plan = replace(plans[chosen], pinned=tuple(sorted(
        set(plans[chosen].pinned) - ({"ckpt_input"} if not pinned else set()))))
    if len(plans) + len(failures) + len(slower) == 1:
        return plan
    return replace(plan, notes=plan.notes + tuple(_reasons(values, plans, failures, slower, chosen)),
                   search_seconds=sum(p.search_seconds for p in plans.values()))


HOST_BINDS = 0.9
"""Share of its host memory a plan with the inputs in host memory must use for the drive to be
tried."""


def _host_binds(plans: dict[str, Plan], failures: dict[str, InfeasibleError]) -> bool:
    """Whether the inputs could gain from the drive: the drive moves the same bytes as host
    memory at a fraction of its bandwidth, so it wins only where host memory is short - the
    plan with the inputs in host memory failed, or fills its host memory (``HOST_BINDS``)."""
    if "host" in failures:
        return True
    p = plans.get("host")
    return p is not None and p.prediction.host_bytes >= HOST_BINDS * p.host_memory


def _to_beat(value: str, plans: dict[str, Plan], tolerance: float) -> float:
    """The step a plan with the inputs at ``value`` must beat to be chosen (``choose_input``):
    the device plan's beyond the error band, and every other place's found so far."""
    if value == "device":
        return float("inf")
    t = [p.fastest() / (1 + tolerance) if v == "device" else p.fastest() for v, p in plans.items()]
    return min(t, default=float("inf"))


def may_gain(plan: Plan) -> bool:
    """Whether saving activation memory (moving the checkpointed inputs, tiling) could make
    ``plan`` faster: not where it keeps every block's activations and every chunk on the device
    (nothing to trade memory for)."""
    k = plan.knobs
    return bool(k.n_checkpoint or k.n_swap or k.n_ssd or k.n_selective or k.n_persist < plan.chunks.n_chunks)


def choose_input(plans: dict[str, Plan], tolerance: float) -> str:
    """``"device"`` unless a place for the inputs gives a plan faster beyond ``tolerance``; of
    the moved ones the faster (host memory before the drive at equal times). Compared by each
    place's fastest plan (``Plan.fastest``, as ``tiles.choose`` says why)."""
    fastest = min(plans, key=lambda v: (plans[v].fastest(), CKPT_INPUTS.index(v)))
    if "device" in plans and plans["device"].fastest() <= plans[fastest].fastest() * (1 + tolerance):
        return "device"
    return fastest


def _fastest(plan: Plan) -> str:
    """" (fastest ...)" where the hedge picked a plan slower than the place's fastest."""
    f = plan.fastest()
    return f" (fastest {fmt_seconds(f)})" if f < plan.prediction.step_time else ""


def _reasons(values, plans, failures, slower, chosen) -> list[str]:
    out = []
    for v in values:
        what = f"checkpointed inputs {'in host memory' if v == 'host' else 'on the ' + v}"
        if v in failures:
            e = failures[v]
            need = (f"needs {fmt_bytes(e.device_needed)} of device memory" if e.device_needed
                    else e.headline)
            out.append(f"{what} does not fit: {need}")
        elif v in slower:
            out.append(f"{what}: no plan below {fmt_seconds(slower[v])} per step (faster than the "
                       f"others' fastest, the device plans' beyond the runtime model's error band)")
        elif v in plans:
            pr = plans[v].prediction
            out.append(f"{what}: step {fmt_seconds(pr.step_time)}{_fastest(plans[v])}, peak "
                       f"{fmt_bytes(pr.peak_device_bytes)}" + (" - chosen" if v == chosen else ""))
    return out


__all__ = ["search", "input_candidates", "choose_input", "may_gain"]
