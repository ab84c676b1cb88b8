"""A tile length as a knob (the head's, ``head_tile``; the MLPs', ``mlp_tile``): an outer loop
around an inner search.

Tiling changes the profile itself (a transform of the figures, as the sequence-parallel degree
does), so the inner search runs once per value: the model's own (0) and one tile length. The
untiled plan wins unless a tiled one is faster beyond the cost model's error band: it is exact,
where tiling reorders sums (rounding-level differences). The untiled value is searched first;
a tiled one only where the untiled plan trades memory for time (``ckpt_input.may_gain``) or
does not fit, and then below the step it must beat (the inner searches' ``beat``), so a
variant that cannot win costs little: its floor (``space.search_floor``) or its points'
bounds (``search.pairs``) rule it out before its points are fitted. Values are compared by their
fastest plans (``Plan.fastest``: ``choose`` says why). A pin fixes the value.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..config import ConfigError, PlannerConfig
from ..plan import Plan
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from ..units import fmt_bytes, fmt_seconds
from .ckpt_input import may_gain
from .infeasible import InfeasibleError

Inner = Callable[..., "Plan | None"]
"""An inner search: (profile, hw, config, *, beat) -> the fastest plan, or None below ``beat``."""


@dataclass(frozen=True)
class TileKnob:
    """One tiling knob, as the loop needs it."""

    name: str
    """The knob's name in Knobs / KnobPins (``head_tile``)."""
    candidates: Callable[[ModelProfile, PlannerConfig], tuple[int, ...]]
    """The values to plan (the pin, checked; or 0 and one tile length)."""
    transform: Callable[[ModelProfile, int], ModelProfile]
    """The profile with the value applied."""
    what: Callable[[int], str]
    """The value in words, for the plan's notes."""


def values(profile: ModelProfile, config: PlannerConfig, knob: str, current: int, figures,
           unsupported: str, what: str, default: Callable[[], int]) -> tuple[int, ...]:
    """A tile knob's values to plan: ``current`` where the profile is tiled already (a
    re-search of it), the pin (refused by name above 0 without the tiled ``figures``), or 0 and
    ``default()`` where the tiled figures exist and the tile is shorter than the micro-batch."""
    if current:
        return (current,)
    pin = getattr(config.pins, knob)
    if pin is not None:
        if pin and figures is None:
            raise ConfigError(
                f"protrain.{knob} = {pin}: this model's {what} cannot be computed over tiles "
                f"({unsupported or 'the profile did not measure it tiled'}); set it to 0 or \"auto\"")
        return (pin,)
    if figures is None or profile.tokens is None:
        return (0,)
    t = default()
    return (0, t) if t < profile.tokens else (0,)


def search(knob: TileKnob, inner: Inner, profile: ModelProfile, hw: HardwareProfile,
           config: PlannerConfig | None = None, *, beat: float = float("inf")) -> Plan | None:
    """The fastest plan over ``knob``'s values, each searched by ``inner``. Raises
    InfeasibleError (the furthest-reaching value's) when nothing fits; None when nothing beats
    ``beat``."""
    config = config or PlannerConfig()
    values = knob.candidates(profile, config)
    pinned = getattr(config.pins, knob.name) is not None
    config = replace(config, pins=replace(config.pins, **{knob.name: None})) if pinned else config
    plans: dict[int, Plan] = {}
    failures: dict[int, InfeasibleError] = {}
    slower: dict[int, float] = {}
    for t in values:
        if t and 0 in plans and not may_gain(plans[0]):
            break                                  # nothing to trade memory for
        to_beat = min([beat] + [p.fastest() / (1 + config.time_tolerance) if v == 0
                                else p.fastest() for v, p in plans.items()])
        try:
            found = inner(knob.transform(profile, t), hw, config, beat=to_beat)
        except InfeasibleError as e:
            failures[t] = e
            continue
        if found is None:
            slower[t] = to_beat
        else:
            plans[t] = found
    if not plans and slower:
        return None
    if not plans:
        raise failures[max(failures)]              # the shortest tile reaches furthest
    chosen = choose(plans, config.time_tolerance)
    plan = plans[chosen]
    if len(values) == 1 and not pinned:
        return plan
    notes = tuple(_reasons(knob, values, plans, failures, slower, chosen))
    return replace(plan, pinned=tuple(sorted(set(plan.pinned) | ({knob.name} if pinned else set()))),
                   notes=plan.notes + notes, search_seconds=sum(p.search_seconds for p in plans.values()))


def choose(plans: dict[int, Plan], tolerance: float) -> int:
    """The untiled value (0) unless a tiled value's fastest plan is faster than the untiled's
    fastest beyond ``tolerance``. The values are compared by their fastest plans (``Plan.fastest``),
    not by the hedge's picks: the hedge picks among plans the model cannot tell apart, and a
    value whose pick is slower than its fastest has not shown it is slower (the inner searches
    prune against these same figures, so a value that cannot win costs little)."""
    fastest = min(plans, key=lambda t: (plans[t].fastest(), t))
    if 0 in plans and plans[0].fastest() <= plans[fastest].fastest() * (1 + tolerance):
        return 0
    return fastest


def _reasons(knob, values, plans, failures, slower, chosen) -> list[str]:
    out = []
    for t in values:
        what = knob.what(t)
        if t in failures:
            e = failures[t]
            need = (f"needs {fmt_bytes(e.device_needed)} of device memory" if e.device_needed
                    else e.headline)
            out.append(f"{what} does not fit: {need}")
        elif t in slower:
            out.append(f"{what}: no plan below {fmt_seconds(slower[t])} per step (the untiled plans' fastest "
                       f"beyond the runtime model's error band)")
        elif t in plans:
            pr = plans[t].prediction
            out.append(f"{what}: step {fmt_seconds(pr.step_time)}{_fastest(plans[t])}, peak "
                       f"{fmt_bytes(pr.peak_device_bytes)} at {pr.peak_at}" + (" - chosen" if t == chosen else ""))
        else:
            out.append(f"{what}: not tried (the untiled plan keeps every activation and chunk on the device)")
    return out


def _fastest(plan: Plan) -> str:
    """" (fastest ...)" where the hedge picked a plan slower than the variant's fastest."""
    f = plan.fastest()
    return f" (fastest {fmt_seconds(f)})" if f < plan.prediction.step_time else ""


__all__ = ["TileKnob", "search", "choose"]
