"""The MLPs' tile (``Knobs.mlp_tile``) as a knob: an outer loop (tiles.py) around the head's.

Tiling every block's MLP (protrain.runtime.tiled_mlp) changes the blocks' figures - a block no
longer saves its MLP's ffn-wide tensors nor makes them for the whole micro-batch at once, one
tile's are made in forward and again in backward - so the profile itself changes
(``with_mlp_tile``) and the head's loop (head.py, and the searches inside it) runs once per
value: the model's own MLPs (0) and one tile length (``default_tile``: a tile's ffn-wide
tensors about as large as the block's input, which a checkpointed block holds anyway). The
untiled MLPs win unless the tiled ones give a plan faster beyond the cost model's error band.
A pin fixes the value; a model whose MLPs cannot be tiled (``ModelProfile.mlp_unsupported``:
a block without an ``mlp``, active dropout) plans with its own, and a pin above 0 on it is
refused by name.
"""
from __future__ import annotations

from ..config import PlannerConfig
from ..plan import Plan
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from ..profile.transforms import with_mlp_tile
from . import tiles
from .head import TILE_GRANULE, search as search_head
from .tiles import TileKnob


def default_tile(profile: ModelProfile) -> int:
    """Tokens per tile: the most whose backward bytes (``MLPProfile.bwd_peak_per_tile_token``)
    stay within a block's input, in granules (and no shorter than the figures hold for)."""
    m = profile.mlp
    per_token = max(m.bwd_peak_per_tile_token, m.fwd_peak_per_tile_token, 1.0)
    t = int(profile.blocks[0].in_bytes // per_token) // TILE_GRANULE * TILE_GRANULE
    floor = -(-int(m.shortest_tile * (profile.tokens or 0)) // TILE_GRANULE) * TILE_GRANULE
    return max(t, floor, TILE_GRANULE)


def tile_candidates(profile: ModelProfile, config: PlannerConfig) -> tuple[int, ...]:
    """The mlp_tile values the loop plans (``tiles.values``)."""
    return tiles.values(profile, config, "mlp_tile", profile.mlp_tile, profile.mlp,
                        profile.mlp_unsupported, "MLPs", lambda: default_tile(profile))


MLP = TileKnob("mlp_tile", tile_candidates, with_mlp_tile,
               lambda t: f"MLPs tiled at {t} tokens" if t else "whole-sequence MLPs")


def search(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig | None = None, *,
           beat: float = float("inf")) -> Plan | None:
    """The fastest plan for ``profile`` on ``hw`` within ``config``'s budgets and pins, over
    the MLPs' tile and the head's. Raises InfeasibleError (with what would fit) when nothing
    does; None when nothing beats ``beat``."""
    return tiles.search(MLP, search_head, profile, hw, config, beat=beat)


__all__ = ["search", "tile_candidates", "default_tile"]
