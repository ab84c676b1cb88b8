"""Which persistent chunks the search shards over the data-parallel ranks (``Knobs.n_shard``).

A sharded persistent chunk keeps 1/world of a persistent chunk's device bytes on each rank
(protrain.runtime.chunks) and pays for it with an all-gather before each use and a
reduce-scatter of its gradients, on the copy queues, and saves device Adam (1/world of the
chunk's elements). For a point of the search - n_persist chunks on the device, an activation
configuration - two counts are simulated: the *fewest* sharded chunks (the last of the
n_persist) with which the point fits, with at least the buffers its streamed chunks need
(where it fits whole, none: the fewest collectives), and the *most* (every chunk past the
layout's min_persist: the least device Adam). Between the two the step trades collectives
the compute may hide for device Adam after backward; counts between are not tried.

Several ranks then keep more of the model on their devices than one: the point with the most
chunks on the device is no longer capped by one device's memory but by the ranks' together.
"""
from __future__ import annotations

import numpy as np

from ..config import PlannerConfig
from ..cost.memory import sharded_state_bytes
from ..layout import ChunkLayout
from .infeasible import InfeasibleError
from .policy import planned_state_bytes


def shards(config: PlannerConfig) -> bool:
    """Whether a plan may shard persistent chunks: several data-parallel ranks, chunks of our
    own (not a framework's fixed model states), and n_shard not pinned to 0. A pinned count
    above 0 where plans cannot shard is refused, by name."""
    able = config.data_parallel_size > 1 and config.model_states_fixed is None
    if config.pins.n_shard and not able:
        raise InfeasibleError(
            f"pinned n_shard={config.pins.n_shard} shards persistent chunks over the data-parallel "
            f"ranks, and " + ("this run has one rank" if config.model_states_fixed is None else
                              "the framework keeps the model states itself (activations only)")
            + "; pin n_shard to 0 or leave it on auto")
    return able and config.pins.n_shard != 0


def most_sharded(config: PlannerConfig, layout: ChunkLayout, n_persist) -> np.ndarray:
    """Per n_persist: the most chunks a point with that many on the device may shard (the pin;
    else every one past ``layout.min_persist``, the chunks that must stay whole); 0 where
    plans do not shard. A floor over a point's unknown count takes this one (its device Adam
    and memory are the least)."""
    n_persist = np.asarray(n_persist, dtype=np.int64)
    if not shards(config):
        return np.zeros_like(n_persist)
    room = np.maximum(n_persist - layout.min_persist, 0)
    return np.minimum(config.pins.n_shard, room) if config.pins.n_shard is not None else room


def least_device_states(profile, config: PlannerConfig, layout: ChunkLayout, persist: np.ndarray) -> np.ndarray:
    """[n_chunks + 1] the least device bytes of the states of n chunks on the device, at index
    n: ``persist`` (every one whole) where plans do not shard, else with the most of them
    sharded (``most_sharded``)."""
    if not shards(config):
        return persist
    n = np.arange(layout.n_chunks + 1)
    rep = n - most_sharded(config, layout, n)
    sharded = sharded_state_bytes(layout, planned_state_bytes(profile, config), config.data_parallel_size)
    return persist[rep] + sharded[n] - sharded[rep]


def fewest_sharded(profile, config: PlannerConfig, layout: ChunkLayout, persist: np.ndarray, buf: int,
                   room: np.ndarray, np_idx: np.ndarray, whole_fits: np.ndarray) -> np.ndarray:
    """Per point: how many of its ``np_idx`` device chunks to shard - none where it fits whole
    (``whole_fits``), the pin where n_shard is pinned, else the fewest with which its states
    and its streamed chunks' least buffers (``layout.min_buffers``; the pinned n_buffer where
    pinned) fit ``room`` (the device bytes left beside its activations and norm scratch).
    A count with which the point cannot fit comes back past ``most_sharded``: the caller's
    fit test drops the point.

    With r chunks whole, the states and buffers take T(r) + S(np) bytes, where
    T(r) = persist[r] - S(r) + buffers(r) * buf and S(k) the first k chunks' shards; the
    fewest sharded is the largest r <= np with T(r) <= room - S(np). T rises with r but for
    the buffers' steps; its running maximum rises, and the largest r under it is the largest
    under T but where T dips (then one chunk more than needed is sharded, never too few)."""
    np_idx = np.asarray(np_idx, dtype=np.int64)
    if not shards(config):
        return np.zeros_like(np_idx)
    if config.pins.n_shard is not None:
        return np.full_like(np_idx, config.pins.n_shard)
    sharded = sharded_state_bytes(layout, planned_state_bytes(profile, config), config.data_parallel_size)
    bufs = (layout.min_buffers_table() if config.pins.n_buffer is None
            else np.full(layout.n_chunks + 1, config.pins.n_buffer, dtype=np.int64))
    rising = np.maximum.accumulate(persist - sharded + bufs * buf)
    rep = np.minimum(np.searchsorted(rising, room - sharded[np_idx], side="right") - 1, np_idx)
    # No r fits: past the most a point may shard (the fit test drops it).
    rep = np.where(rep < layout.min_persist, -1, rep)
    return np.where(whole_fits, 0, np_idx - rep)


__all__ = ["shards", "most_sharded", "least_device_states", "fewest_sharded"]
