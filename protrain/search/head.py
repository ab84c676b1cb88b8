"""The head's tile (``Knobs.head_tile``) as a knob: an outer loop around the inner search.

Tiling the head and loss (protrain.runtime.tiled_head) changes the post part's figures - the
whole tokens x vocab logits are never made, one tile's are, and backward recomputes them - so,
as the sequence-parallel degree does, it changes the profile itself (``with_head_tile``) and
the inner search (loop.py) runs once per value: the model's own head (0) and one tile length
(``default_tile``: a tile's logits and their gradients about as large as the micro-batch's
hidden states, which the post part holds anyway). The whole-logits head wins unless the
tiled one is faster beyond the cost model's error band: it is exact, where tiling reorders
two sums (rounding-level differences). A pin fixes the value; a model whose head cannot be
tiled (``ModelProfile.head_unsupported``) plans with its own head, and a pin above 0 on it
is refused by name.
"""
from __future__ import annotations

from dataclasses import replace

from ..config import ConfigError, PlannerConfig
from ..plan import Plan
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from ..profile.transforms import with_head_tile
from ..units import fmt_bytes, fmt_seconds
from .infeasible import InfeasibleError
from .ckpt_input import search as search_one

TILE_GRANULE = 128
"""Tile lengths are multiples of this many tokens (and at least one granule)."""


def default_tile(profile: ModelProfile) -> int:
    """Tokens per tile: the most whose backward bytes (``HeadProfile.bwd_peak_per_tile_token``)
    stay within the micro-batch's hidden states (the post part's input), in granules."""
    h = profile.head
    per_token = max(h.bwd_peak_per_tile_token, h.fwd_peak_per_tile_token, 1.0)
    t = int(profile.parts[-1].in_bytes // per_token) // TILE_GRANULE * TILE_GRANULE
    return max(t, TILE_GRANULE)


def tile_candidates(profile: ModelProfile, config: PlannerConfig) -> tuple[int, ...]:
    """The head_tile values the loop plans: the pin (checked), or 0 and ``default_tile`` where
    the head can be tiled and the tile is shorter than the micro-batch."""
    if profile.head_tile:                          # a profile already tiled (a re-search of it)
        return (profile.head_tile,)
    pin = config.pins.head_tile
    if pin is not None:
        if pin and profile.head is None:
            raise ConfigError(
                f"protrain.head_tile = {pin}: this model's head and loss cannot be computed over "
                f"tiles ({profile.head_unsupported or 'the profile did not measure a tiled head'}); "
                f"set it to 0 or \"auto\"")
        return (pin,)
    if profile.head is None or profile.tokens is None:
        return (0,)
    t = default_tile(profile)
    return (0, t) if t < profile.tokens else (0,)


def search(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig | None = None) -> Plan:
    """The fastest plan for ``profile`` on ``hw`` within ``config``'s budgets and pins, over
    the head's tile too. Raises InfeasibleError (with what would fit) when nothing does."""
    config = config or PlannerConfig()
    tiles = tile_candidates(profile, config)
    pinned = config.pins.head_tile is not None
    inner = replace(config, pins=replace(config.pins, head_tile=None)) if pinned else config
    plans: dict[int, Plan] = {}
    failures: dict[int, InfeasibleError] = {}
    for t in tiles:
        try:
            plans[t] = search_one(with_head_tile(profile, t), hw, inner)
        except InfeasibleError as e:
            failures[t] = e
    if not plans:
        raise failures[max(failures)]              # the tiled head's reaches furthest
    chosen = choose_tile(plans, config.time_tolerance)
    plan = plans[chosen]
    if len(tiles) == 1 and not pinned:
        return plan
    notes = tuple(_reasons(tiles, plans, failures, chosen))
    return replace(plan, pinned=tuple(sorted(plan.pinned + (("head_tile",) if pinned else ()))),
                   notes=plan.notes + notes, search_seconds=sum(p.search_seconds for p in plans.values()))


def choose_tile(plans: dict[int, Plan], tolerance: float) -> int:
    """The model's own head (0) unless a tiled plan is faster beyond ``tolerance``."""
    fastest = min(plans, key=lambda t: (plans[t].prediction.step_time, t))
    if 0 in plans and plans[0].prediction.step_time <= plans[fastest].prediction.step_time * (1 + tolerance):
        return 0
    return fastest


def _reasons(tiles, plans, failures, chosen) -> list[str]:
    out = []
    for t in tiles:
        what = f"head tiled at {t} tokens" if t else "whole-logits head"
        if t in failures:
            e = failures[t]
            need = (f"needs {fmt_bytes(e.device_needed)} of device memory" if e.device_needed
                    else str(e).split(";")[0])
            out.append(f"{what} does not fit: {need}")
            continue
        pr = plans[t].prediction
        out.append(f"{what}: step {fmt_seconds(pr.step_time)}, peak {fmt_bytes(pr.peak_device_bytes)} "
                   f"at {pr.peak_at}" + (" - chosen" if t == chosen else ""))
    return out


__all__ = ["search", "tile_candidates", "default_tile", "choose_tile", "TILE_GRANULE"]
