"""The candidate space bounded before it is fitted: per chunk size, the activation
configurations that fit next to the fewest persistent chunks, sorted by their recompute (in
``RECOMPUTE_BUCKETS`` ranges) and then their swapped and drive bytes, and cut into blocks of
``BLOCK_CONFIGS``; each block with each n_persist is one pair of the space,
with a lower bound on the step of every point in it and on the bytes it moves. The search
(loop.py) fits a pair - works out its points' buffers, host memory, chunks on the drive and
exact bounds (space.grid_of_pairs) - only once its bounds say a point in it may be needed: the
fastest plan's, in bound order, or the hedge's, within the band and below the fewest bytes
found. A 70B model with a drive has millions of points, of which a few tens of thousands
are ever needed.

The bounds are ``bounds.step_lower_bound`` and the bytes of ``space``'s grid, taken at the
block's least recompute, forward writes, swapped and drive bytes and activation peak (each only
rises with those), with the host-side figures bounded over the block (``_floors``);
tests/test_search.py checks every point of a fitted pair against its pair."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..config import PlannerConfig
from ..cost.memory import (activation_file_space, buffer_numel, ckpt_input_bytes, least_activation_peak,
                           offload_bytes)
from ..layout import ChunkLayout, build_layout
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from ..cost.host_share import host_memory_share
from .bounds import step_lower_bound
from .candidates import ActivationConfigs, CandidateGrid
from .policy import norm_scratch, planned_state_bytes
from .sharding import least_device_states, most_sharded
from .infeasible import InfeasibleError
from .space import (_drive_states, _fitting_configs, _persistent_counts, _state_io_top, _state_top,
                    candidate_capacities, chunk_bytes_prefix, grid_of_pairs, model_state_bytes, most_buffers,
                    new_seen, reupload_bytes)

BLOCK_CONFIGS = 64
RECOMPUTE_BUCKETS = 64
"""Recompute ranges the configurations are grouped by before their moved bytes (``pair_space``)."""
"""Activation configurations per block: fewer bound the points more tightly, more make the
pairs fewer (their bounds are computed for every pair up front)."""


@dataclass
class PairSpace:
    """One chunk size's pairs (block of configurations, n_persist), fitted or not."""

    layout: ChunkLayout
    order: np.ndarray
    """The configurations that fit next to the fewest persistent chunks, by recompute range,
    then swapped and drive bytes, then recompute."""
    starts: np.ndarray
    """Block b holds ``order[starts[b]:starts[b + 1]]``."""
    block: np.ndarray
    """[V] each pair's block."""
    n_persist: np.ndarray
    """[V] each pair's n_persist."""
    bound: np.ndarray
    """[V] a lower bound on the step (``step_lower_bound``) of every point of the pair."""
    moved: np.ndarray
    """[V] a lower bound on the bytes every point of the pair moves per step."""
    fitted: np.ndarray
    """[V] whether the pair's points are in the search's grids."""
    seen: dict
    """What fitting gathers for the diagnosis (``space.note_buffers``)."""

    @property
    def sizes(self) -> np.ndarray:
        """[V] points in each pair (before fitting)."""
        return (self.starts[1:] - self.starts[:-1])[self.block]

    def unfitted_points(self) -> int:
        return int(self.sizes[~self.fitted].sum())


def pair_space(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig, acts: ActivationConfigs,
               chunk_numel: int, budget: float, block_configs: int = BLOCK_CONFIGS) -> PairSpace:
    """The pairs of chunks of ``chunk_numel`` elements, none fitted (``budget``: the device's
    bytes, the margin taken off), in blocks of ``block_configs`` configurations."""
    layout = build_layout(profile, chunk_numel)
    fits, nps = _fitting_configs(profile, hw, config, acts, layout, budget)
    # By recompute in buckets, then the bytes swapped and written to the drive: a block's
    # configurations alike in both (its step bound follows the recompute, its bytes the rest).
    rec = acts.recompute[fits]
    span = float(rec.max() - rec.min()) if len(rec) else 0.0
    bucket = np.floor((rec - rec.min()) / span * RECOMPUTE_BUCKETS).astype(np.int64) if span > 0 else rec * 0
    order = fits[np.lexsort((rec, acts.swap_host[fits] + acts.ssd[fits], bucket))]
    starts = np.append(np.arange(0, len(order), block_configs), len(order)).astype(np.int64)
    heads = starts[:-1]
    least = (lambda x: np.minimum.reduceat(x[order], heads)) if len(order) else (lambda x: x[:0])  # noqa: E731
    # A configuration per block with the least of each figure the bounds rise with.
    floor_acts = replace(acts, recompute=least(acts.recompute), fwd_write=least(acts.fwd_write),
                         bwd_read=least(acts.bwd_read), swap_host=least(acts.swap_host), ssd=least(acts.ssd),
                         act_peak=least(acts.act_peak))
    block, n_persist = (x.ravel() for x in np.meshgrid(np.arange(len(heads)), nps, indexing="ij"))
    # A pair none of whose points can fit the device is left out: the least activation peak of
    # its block beside the least states of its chunks on the device (sharded where plans shard).
    persist = model_state_bytes(profile, config, layout)[0]
    need = (floor_acts.act_peak[block] + least_device_states(profile, config, layout, persist)[n_persist]
            + norm_scratch(profile, config, layout)[n_persist])
    block, n_persist = block[need <= budget], n_persist[need <= budget]
    swap_most = np.maximum.reduceat(acts.swap_host[order], heads) if len(order) else acts.swap_host[:0]
    bound, moved = _floors(profile, hw, config, floor_acts, swap_most, layout, budget, block, n_persist)
    return PairSpace(layout, order, starts, block, n_persist, bound, moved,
                     fitted=np.zeros(len(block), dtype=bool), seen=new_seen())


def _floors(profile, hw, config, floor_acts: ActivationConfigs, swap_most, layout, budget: float, block,
            n_persist):
    """Per pair: a lower bound on the step (``step_lower_bound``) and on the bytes moved per step
    (``space._grid_block``'s ``moved``) of each of its points. Both take the most buffers the
    least activation peak leaves (re-uploads only fall with buffers), the least swapped and
    drive bytes, and for the drive's floor and bytes the fewest chunks' states on the drive,
    those the least host bytes need; the verdict's chain takes the most, those the most host
    bytes need (``swap_most``), and the least host memory a point can hold after moving its
    states (the speculation's room: a point that moved some holds at least the host share
    less one chunk's states, for it moved the fewest that fit)."""
    if not len(block):
        return np.zeros(0), np.zeros(0)
    nch = layout.n_chunks
    persist, host_state = model_state_bytes(profile, config, layout)
    buf = buffer_numel(layout, config.data_parallel_size) * planned_state_bytes(profile, config).buffer
    # Where plans shard, a point holds at least the states of its chunks the most sharded,
    # and streams at most the chunks past the whole ones (``sharding.most_sharded``).
    ns = most_sharded(config, layout, n_persist)
    least = least_device_states(profile, config, layout, persist)
    rem = budget - floor_acts.act_peak[block] - least[n_persist] - norm_scratch(profile, config, layout)[n_persist]
    nb = most_buffers(config, rem, buf, nch - n_persist + ns)
    host = host_state[n_persist] + floor_acts.swap_host[block]
    ssd = activation_file_space(floor_acts.ssd[block], profile.n_blocks)
    nv = np.minimum(_drive_states(profile, hw, config, layout, n_persist, host, ssd, {})[0], nch - n_persist)
    nv_most = np.minimum(_drive_states(profile, hw, config, layout, n_persist, host_state[n_persist] +
                                       swap_most[block], ssd, {})[0], nch - n_persist)
    top = _state_top(profile, config, layout)
    host_least = np.where(nv_most > 0, np.minimum(host, host_memory_share(hw) - int(np.diff(top).max(initial=0))),
                          host)
    bound = step_lower_bound(profile, hw, config, floor_acts, layout, block, n_persist, nb, host_least, nv,
                             nvme_most=nv_most, n_shard=ns)[0]
    ub = chunk_bytes_prefix(layout, profile, config)
    moved = config.grad_accumulation_steps * (
        2.0 * (ub[nch] - ub[n_persist]) + reupload_bytes(layout, profile, config, n_persist, nb) +
        2.0 * (floor_acts.swap_host[block] + floor_acts.ssd[block])) + _state_io_top(profile, config, layout)[nv]
    return bound, moved


def activation_free_floor(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig) -> float:
    """A lower bound on the step of every point the search could build for ``profile``,
    whatever its activation configuration: ``_floors`` of every chunk size and n_persist at one
    configuration holding the least of each figure the bound rises with (no recompute, nothing
    swapped or written to the drive, the least activation peak any layout can have:
    ``cost.memory.least_activation_peak``; each pair's own least is at or above it) and, for
    the verdict's chain, which falls with them, the most host bytes any configuration can swap
    (every block's larger of its saved tensors and its input). Tighter
    than ``space.search_floor`` - the backward and CPU Adam's chain after it, the buffers, the
    speculation's room - and still without the activation configurations: an outer loop's
    variant that cannot beat its incumbent (a tiled MLP's longer backward) is ruled out before
    they are built (a 70B model on 8 ranks: 0.5 s each). 0 where the search would refuse the
    configuration (it says why)."""
    hw = hw.with_limits(device_memory=config.device_memory, host_memory=config.host_memory)
    budget = hw.device_memory / (1.0 + config.memory_margin)
    moved_inputs = (config.pins.ckpt_input or "device") == "host"
    swap_most = sum(max(offload_bytes(b), ckpt_input_bytes(b) if moved_inputs else 0) for b in profile.blocks)
    zero_f, zero_i = np.zeros(1), np.zeros(1, dtype=np.int64)
    peak = least_activation_peak(profile)
    free = ActivationConfigs(n_blocks=profile.n_blocks, n_ckpt=zero_i, n_swap=zero_i, n_ssd=zero_i,
                             n_sel=zero_i, act_peak=np.array([peak], dtype=np.int64), swap_host=zero_i,
                             ssd=zero_i, recompute=zero_f, fwd_write=zero_f, bwd_read=zero_f)
    floors = []
    try:
        for cap in candidate_capacities(profile, config):
            layout = build_layout(profile, cap)
            persist = model_state_bytes(profile, config, layout)[0]
            nps = _persistent_counts(profile, config, layout, persist, budget)
            nps = nps[peak + least_device_states(profile, config, layout, persist)[nps]
                      + norm_scratch(profile, config, layout)[nps] <= budget]
            block = np.zeros(len(nps), dtype=np.int64)
            bound = _floors(profile, hw, config, free, np.array([swap_most], dtype=np.int64), layout, budget,
                            block, nps)[0]
            if len(bound):
                floors.append(float(bound.min()))
    except InfeasibleError:
        return 0.0
    return min(floors, default=0.0)     # (nothing fits: the search says why)


def fit_pairs(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig, acts: ActivationConfigs,
              ps: PairSpace, which: np.ndarray, budget: float, stats: dict) -> CandidateGrid:
    """The points of pairs ``which`` that fit (``space.grid_of_pairs``); marks them fitted."""
    ps.fitted[which] = True
    b = ps.block[which]
    lens = ps.starts[b + 1] - ps.starts[b]
    first = np.repeat(ps.starts[b], lens)
    offset = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    a_idx = ps.order[first + offset]
    np_idx = np.repeat(ps.n_persist[which], lens)
    return grid_of_pairs(profile, hw, config, acts, ps.layout, budget, stats, ps.seen, a_idx, np_idx)
