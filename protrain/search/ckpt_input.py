"""Where the checkpointed blocks keep their inputs (``Knobs.ckpt_input``): an outer loop around
the inner search.

A checkpointed block keeps only its input for backward; at long sequences those inputs add up
(Llama-3 8B at 256K tokens: 32 blocks x 2 GiB). ``"host"`` moves them to pinned host memory
(BlockMode.CKPT_HOST: copied off on the offload queue in forward, fetched back one block ahead
of the block's backward), as Hugging Face's ``gradient_checkpointing_kwargs={"offload": True}``
and ALST do by hand. It changes which block layouts exist, not the profile, so the inner search
(loop.py) runs once per value, with the value pinned. The inputs stay on the device unless
moving them gives a plan faster beyond the cost model's error band: moving them costs PCIe
time and host memory the other knobs could use, and a plan that fits both ways is at least as
fast kept. A pin fixes the value.
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


def input_candidates(profile: ModelProfile, config: PlannerConfig) -> tuple[str, ...]:
    """The values the loop plans: the pin, or both where a block may be checkpointed."""
    if config.pins.ckpt_input is not None:
        return (config.pins.ckpt_input,)
    if not profile.n_blocks or config.pins.n_checkpoint == 0 or profile.inplace_blocks:
        return ("device",)
    if config.model_states_fixed is not None:
        # The Megatron adapter (the framework keeps the model states): its layers run
        # Megatron's recompute or ProTrain's hooks without this mode (refused there as a pin).
        return ("device",)
    return CKPT_INPUTS


def search(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig | None = None) -> Plan:
    """The fastest plan for ``profile`` on ``hw`` within ``config``'s budgets and pins, over
    where the checkpointed blocks keep their inputs. Raises InfeasibleError (with what would
    fit) when nothing does."""
    config = config or PlannerConfig()
    values = input_candidates(profile, config)
    pinned = config.pins.ckpt_input is not None
    plans: dict[str, Plan] = {}
    failures: dict[str, InfeasibleError] = {}
    slower: dict[str, float] = {}
    for v in values:
        inner = replace(config, pins=replace(config.pins, ckpt_input=v))
        # Moving the inputs is taken only if faster beyond the error band: once the device plan
        # is known, the search for the other needs to look only below that.
        beat = (plans["device"].prediction.step_time / (1 + config.time_tolerance)
                if v != "device" and "device" in plans else float("inf"))
        try:
            found = search_one(profile, hw, inner, beat=beat)
        except InfeasibleError as e:
            failures[v] = e
            continue
        if found is None:
            slower[v] = beat
        else:
            plans[v] = found
        if v == "device" and not _may_gain(found):
            break
    if not plans:       # (a pruned search had a device plan to beat: every value failed here)
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


def _may_gain(plan: Plan) -> bool:
    """Whether moving the checkpointed inputs could make ``plan`` faster: not where it keeps
    every block's activations and every chunk on the device (nothing to trade memory for)."""
    k = plan.knobs
    return bool(k.n_checkpoint or k.n_swap or k.n_ssd or k.n_selective or k.n_persist < plan.chunks.n_chunks)


def choose_input(plans: dict[str, Plan], tolerance: float) -> str:
    """``"device"`` unless the plan with the inputs on the host is faster beyond ``tolerance``."""
    fastest = min(plans, key=lambda v: (plans[v].prediction.step_time, v != "device"))
    if "device" in plans and \
            plans["device"].prediction.step_time <= plans[fastest].prediction.step_time * (1 + tolerance):
        return "device"
    return fastest


def _reasons(values, plans, failures, slower, chosen) -> list[str]:
    out = []
    for v in values:
        what = f"checkpointed inputs on the {v}"
        if v in failures:
            e = failures[v]
            need = (f"needs {fmt_bytes(e.device_needed)} of device memory" if e.device_needed
                    else str(e).split(";")[0])
            out.append(f"{what} does not fit: {need}")
        elif v in slower:
            out.append(f"{what}: no plan below {fmt_seconds(slower[v])} per step (faster than the "
                       f"device plan beyond the runtime model's error band)")
        elif v in plans:
            pr = plans[v].prediction
            out.append(f"{what}: step {fmt_seconds(pr.step_time)}, peak {fmt_bytes(pr.peak_device_bytes)}"
                       + (" - chosen" if v == chosen else ""))
    return out


__all__ = ["search", "input_candidates", "choose_input"]
