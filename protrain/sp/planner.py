"""The sequence-parallel degree P as a knob: an outer loop around the search.

P changes the profile itself (each rank holds 1/P of every activation and of every FLOP, and
pays Ulysses' all-to-alls), so for each valid P the loop derives the per-rank profile
(protrain.sp.scaling), runs the one search (protrain.search) on it and keeps the fastest
optimizer step - the smallest P predicted within the model's error band of it
(``choose_degree``); the plan's notes say what every P gave ("P=1 does not fit: ...").
The degrees are searched in the order of a floor on their step (``search_floor``, from the
chunk layouts alone), and one whose floor lies above the fastest step found and the band
over it is skipped: it could not be chosen ("P=2 not searched: ...").

A group of P ranks runs the P micro-batches its ranks received one after another, each split
over the group (protrain.sp.batch), so the global batch stays the user's: per rank, an
optimizer step is P x gradient_accumulation_steps micro-steps of 1/P of a sequence each. The
model states stay sharded over all ranks (data_parallel_size = world).

Framework-neutral: the DeepSpeed engine calls it with its world size; the Megatron adapter
calls it for the context-parallel size (protrain_megatron.context_parallel) with Megatron's
constraints and names.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ..config import ConfigError, PlannerConfig
from ..plan import Plan
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from ..search import InfeasibleError, search, search_floor
from ..units import fmt_bytes, fmt_seconds
from .degree import SPShape, broken_constraints, check_degree, seq_step, valid_degrees
from .scaling import alltoall_bandwidth, scale_profile


def sp_shape(profile: ModelProfile, world: int, seq_len: int | None = None) -> SPShape:
    return SPShape(world=world, heads=profile.heads, kv_heads=profile.kv_heads or profile.heads,
                   seq_len=seq_len or profile.seq_len or 0)


def candidate_degrees(profile: ModelProfile, config: PlannerConfig, world: int,
                      seq_len: int | None = None, unsupported: str | None = None,
                      shape: SPShape | None = None, where: str = "protrain.sequence_parallel",
                      auto: str = '(or "auto")') -> tuple[int, ...]:
    """The degrees the loop tries: the pinned one (checked), else every valid one. A model
    the runtime cannot split (``unsupported`` says why) gets P = 1, and a pin above 1 fails.
    ``shape``: the constraints (default: the profile's heads and sequence, ``world`` ranks);
    ``where`` / ``auto``: the setting's name and how to leave it to the planner, for errors."""
    pin = config.pins.sequence_parallel
    if pin is not None and pin > 1 and unsupported:
        raise ConfigError(f"{where} = {pin}: {unsupported}")
    shape = shape or sp_shape(profile, world, seq_len)
    if pin is not None:
        check_degree(pin, shape, where, auto)
        return (pin,)
    if unsupported:
        return (1,)
    return valid_degrees(shape)


def search_sequence_parallel(profile: ModelProfile, hw: HardwareProfile,
                             config: PlannerConfig | None = None, *, seq_len: int | None = None,
                             micro_batch: int | None = None, unsupported: str | None = None,
                             second: ModelProfile | None = None, shape: SPShape | None = None,
                             per_rank: Callable[[ModelProfile], ModelProfile] | None = None,
                             where: str = "protrain.sequence_parallel",
                             auto: str = '(or "auto")') -> Plan:
    """The fastest plan over the sequence-parallel degrees (and every other knob), for
    ``profile`` measured on one rank at its batch shape, training micro-batches of
    ``micro_batch`` samples of ``seq_len`` tokens (default: the profile's) on
    ``config.data_parallel_size`` ranks. ``second``: the same model profiled at a shorter
    length, to separate what grows with the sequence from what does not (protrain.sp.scaling)
    at the degrees where a rank holds fewer tokens than were measured; where it holds as many
    or more, the byte figures are scaled linearly, an upper bound (a fit through two shorter
    profiles can miss a line that overtakes further on). Megatron's context parallelism passes its ``shape`` (constraints),
    ``per_rank`` (applied to each degree's per-rank profile: micro-batches in flight) and the
    flag's name for errors (``where``, ``auto``)."""
    config = config or PlannerConfig()
    world = config.data_parallel_size
    seq_len = seq_len or profile.seq_len
    degrees = candidate_degrees(profile, config, world, seq_len, unsupported, shape, where, auto)
    bandwidth = alltoall_bandwidth(hw)
    inner_pins = replace(config.pins, sequence_parallel=None)
    plans: dict[int, Plan] = {}
    failures: dict[int, InfeasibleError] = {}
    a2a: dict[int, float] = {}
    inner: dict[int, tuple[ModelProfile, PlannerConfig]] = {}
    per_sample = (micro_batch or profile.micro_batch or 1) / (profile.micro_batch or 1)
    for p in degrees:
        below = bool(seq_len) and seq_len * per_sample / p < (profile.seq_len or 0)
        scaled = scale_profile(profile, seq_len=seq_len, degree=p, alltoall_bandwidth=bandwidth,
                               second=second if below else None, micro_batch=micro_batch)
        a2a[p] = sum(b.comm_fwd_time + b.comm_bwd_time for b in scaled.blocks) * \
            config.grad_accumulation_steps * p
        inner[p] = (per_rank(scaled) if per_rank else scaled,
                    replace(config, pins=inner_pins, grad_accumulation_steps=config.grad_accumulation_steps * p))
    floors = {p: search_floor(prof, hw, cfg) for p, (prof, cfg) in inner.items()}
    pruned: dict[int, tuple[float, int]] = {}
    for p in sorted(degrees, key=lambda p: (floors[p], p)):     # the likely fastest first
        rival = _rival(plans, floors[p], config.time_tolerance)
        if rival is not None:
            pruned[p] = (floors[p], rival)
            continue
        prof, cfg = inner[p]
        try:
            plans[p] = search(prof, hw, cfg)
        except InfeasibleError as e:
            failures[p] = e
    chosen = choose_degree(plans, config.time_tolerance)
    why = _reasons(degrees, plans, failures, a2a, shape or sp_shape(profile, world, seq_len),
                   unsupported, chosen, config.time_tolerance,
                   pinned=config.pins.sequence_parallel is not None, pruned=pruned)
    if not plans:
        last = failures[max(failures)]
        k = (shape.knob if shape else "P")
        fits = [n for p, e in failures.items() if (n := fitting_length(e, p, shape))]
        raise InfeasibleError(f"no {'context' if k == 'CP' else 'sequence'}-parallel degree fits: "
                              + "; ".join(why) + "."
                              + ("" if len(failures) == 1 else f" With {k}={max(failures)}: {last}"),
                              device_needed=last.device_needed, host_needed=last.host_needed,
                              micro_batch_fit=last.micro_batch_fit, seq_len_fit=max(fits, default=None))
    plan = plans[chosen]
    pinned = plan.pinned + (("sequence_parallel",) if config.pins.sequence_parallel is not None else ())
    return replace(plan, knobs=replace(plan.knobs, sequence_parallel=chosen), pinned=tuple(sorted(pinned)),
                   notes=plan.notes + tuple(why),
                   search_seconds=sum(x.search_seconds for x in plans.values()))


def fitting_length(error: InfeasibleError, degree: int, shape: SPShape | None = None) -> int | None:
    """The sequence length ``error`` (a degree's search that did not fit the device) says its
    activations would fit at, rounded down to the degree's granule (``seq_step``): 0 where not
    even one granule fits, None where it gives none (the host or the model states bind)."""
    if error.seq_len_fit is None:
        return None
    step = seq_step(degree, shape)
    return error.seq_len_fit // step * step


def _fits_up_to(error: InfeasibleError, degree: int, shape: SPShape) -> str:
    """The longest sequence a degree that does not fit would fit, for its line (``protrain
    plan --seq max`` plans its way to the exact one)."""
    n = fitting_length(error, degree, shape)
    if n is None:
        return ""
    return (f" (sequences up to about {n} tokens fit)" if n else
            f" (not even {seq_step(degree, shape)} tokens fit)")


def _rival(plans: dict[int, Plan], floor: float, tolerance: float) -> int | None:
    """The degree that rules out one whose step is at least ``floor``: the fastest searched
    so far, where ``floor`` lies above its step and the error band over it. Such a degree is
    then neither the fastest nor within the band of the fastest (which is no slower), so
    ``choose_degree`` cannot pick it and no note compares it. None where nothing rules it out."""
    if not plans:
        return None
    best = min(plans, key=lambda p: (plans[p].prediction.step_time, p))
    return best if floor > plans[best].prediction.step_time * (1 + tolerance) else None


def choose_degree(plans: dict[int, Plan], tolerance: float) -> int | None:
    """The degree to run: the smallest one predicted within ``tolerance`` (the runtime
    model's error band) of the fastest. A smaller degree moves fewer all-to-all bytes and
    splits each sequence over fewer ranks, and a difference inside the band is one the model
    cannot vouch for (the same hedge as the search's among plans of one degree). Ranks that
    plan alone (Megatron's choice at argument parsing) also agree more often this way."""
    if not plans:
        return None
    fastest = min(p.prediction.step_time for p in plans.values())
    return min(p for p, plan in plans.items() if plan.prediction.step_time <= fastest * (1 + tolerance))


def _reasons(degrees, plans, failures, a2a, shape: SPShape, unsupported, best: int | None,
             tolerance: float, pinned: bool = False, pruned: dict | None = None) -> list[str]:
    """One line per degree tried, and why the others were not. ``pruned``: the degrees not
    searched, each with its floor and the degree whose step ruled it out."""
    out = []
    k = shape.knob
    world = shape.world
    for p in degrees:
        if p in (pruned or {}):
            floor, q = pruned[p]
            out.append(f"{k}={p} not searched: every plan takes at least {fmt_seconds(floor)} per step "
                       f"(compute, uploads and CPU Adam alone), slower than {k}={q}'s "
                       f"{fmt_seconds(plans[q].prediction.step_time)} by more than the model's "
                       f"{tolerance:.0%} error band")
            continue
        if p in failures:
            e = failures[p]
            need = (f"needs {fmt_bytes(e.device_needed)} of device memory" if e.device_needed else
                    f"needs {fmt_bytes(e.host_needed)} of host memory per rank" if e.host_needed else
                    e.headline)
            out.append(f"{k}={p} does not fit: {need}" + _fits_up_to(e, p, shape))
            continue
        pr = plans[p].prediction
        line = (f"{k}={p}: step {fmt_seconds(pr.step_time)}, peak {fmt_bytes(pr.peak_device_bytes)}, "
                f"modes {''.join(m.letter for m in plans[p].block_modes)}"
                + (f", all-to-all {fmt_seconds(a2a[p])} per step" if p > 1 else ""))
        out.append(line + (" - chosen" if p == best else ""))
    fastest = min(plans, key=lambda p: (plans[p].prediction.step_time, p)) if plans else None
    if fastest is not None and fastest != best:
        gain = 1 - plans[fastest].prediction.step_time / plans[best].prediction.step_time
        out.append(f"{k}={best} chosen over {k}={fastest}: {k}={fastest} is predicted {gain:.1%} faster, "
                   f"within the model's {tolerance:.0%} error band, and moves more all-to-all bytes")
    if unsupported and world > 1:
        out.append(f"sequence parallelism off: {unsupported}")
    elif len(degrees) == 1 and world > 1 and degrees[0] == 1 and not pinned:
        others = [p for p in range(2, world + 1) if world % p == 0]
        if others:
            out.append(f"{k}>1 not possible: {k}={others[0]}: "
                       + "; ".join(broken_constraints(others[0], shape)))
    return out

