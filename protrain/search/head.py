"""The head's tile (``Knobs.head_tile``) as a knob: an outer loop (tiles.py) around the inner
search.

Tiling the head and loss (protrain.runtime.tiled_head) changes the post part's figures - the
whole tokens x vocab logits are never made, one tile's are, and backward recomputes them - so,
as the sequence-parallel degree does, it changes the profile itself (``with_head_tile``) and
the inner search (ckpt_input.py, loop.py) runs once per value: the model's own head (0) and one
tile length (``default_tile``: a tile's logits and their gradients about as large as the
micro-batch's hidden states, which the post part holds anyway). The whole-logits head wins
unless the tiled one is faster beyond the cost model's error band. A pin fixes the value; a model whose head cannot be
tiled (``ModelProfile.head_unsupported``) plans with its own head, and a pin above 0 on it
is refused by name.
"""
from __future__ import annotations

from ..config import PlannerConfig
from ..plan import Plan
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from ..profile.transforms import with_head_tile
from . import tiles
from .ckpt_input import search as search_one
from .tiles import TileKnob

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
    """The head_tile values the loop plans (``tiles.values``)."""
    return tiles.values(profile, config, "head_tile", profile.head_tile, profile.head,
                        profile.head_unsupported, "head and loss", lambda: default_tile(profile))


HEAD = TileKnob("head_tile", tile_candidates, with_head_tile,
                lambda t: f"head tiled at {t} tokens" if t else "whole-logits head")


def search(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig | None = None, *,
           beat: float = float("inf")) -> Plan | None:
    """The fastest plan for ``profile`` on ``hw`` within ``config``'s budgets and pins, over
    the head's tile too. Raises InfeasibleError (with what would fit) when nothing does; None
    when nothing beats ``beat`` (an outer loop's incumbent)."""
    return tiles.search(HEAD, search_one, profile, hw, config, beat=beat)


choose_tile = tiles.choose


__all__ = ["search", "tile_candidates", "default_tile", "choose_tile", "TILE_GRANULE"]
