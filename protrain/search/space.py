"""The candidate space: the activation configurations (n_checkpoint, n_swap, n_ssd,
n_selective) the search enumerates, and per chunk size the grid of points that fit the
device, host and drive - each with the most buffers that still fit (more buffers never delay
anything; the search re-checks ties with fewer), its lower bound on the step time
(search.bounds) and the bytes it moves per step."""
from __future__ import annotations

import numpy as np

from ..block_mode import CKPT, CKPT_HOST, CKPT_SSD, NONE, SEL, SSD, SWAP, full_recompute, layout_codes
from ..config import ALL, PlannerConfig
from ..cost.chunk_times import state_io_times
from ..cost.host_share import host_memory_share, nvme_free_share, rank_rates
from ..cost.memory import (activation_file_space, activation_walk, buffer_numel, ckpt_input_bytes, nvme_file_top,
                           nvme_state_top, offload_bytes, sharded_state_bytes, staging_bytes)
from ..layout import build_layout, chunk_capacities, why_persistent
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from ..units import fmt_bytes
from .bounds import backward_chain, degree_floor, forward_chain, step_lower_bound
from .candidates import ActivationConfigs, CandidateGrid
from .infeasible import InfeasibleError
from .sharding import fewest_sharded, least_device_states, most_sharded
from .policy import (backup_from_top, drive_states_possible, norm_scratch, pinned_speculation,
                     planned_state_bytes, speculative_writes)


def max_ssd_blocks(profile: ModelProfile, hw: HardwareProfile, states_busy: float = 0.0) -> int:
    """SSD blocks worth considering: the leading blocks whose writes the drive can absorb
    within one iteration's compute (SSDTrain's adaptive amount, bounded more loosely), less
    ``states_busy``, the seconds it writes optimizer states in every plan
    (``least_state_drive_time``). More would make the drive the bottleneck; CKPT and SWAP
    remain for the memory beyond that."""
    rr = rank_rates(hw)
    if rr.nvme_write <= 0 or rr.nvme_read <= 0:
        return 0
    budget = sum(p.fwd_time + p.bwd_time for p in profile.parts) - states_busy
    total, n = 0.0, 0
    for b in profile.blocks:
        total += offload_bytes(b) / rr.nvme_write
        if total > budget:
            break
        n += 1
    return n


def least_state_drive_time(profile: ModelProfile, config: PlannerConfig, hw: HardwareProfile, caps,
                           budget: float) -> float:
    """Seconds the drive writes optimizer states in every plan (and reads them, where the two
    share the drive's time: ``HardwareProfile.nvme_duplex``): where no plan fits the host
    without the drive (not even with the most persistent chunks the device takes and no
    swapped activations), the write-backs of the fewest chunks' states that fit it, over the
    chunk sizes ``caps`` (the pin where n_nvme is pinned); else 0."""
    if not drive_states_possible(config, hw):
        return 0.0
    least = np.inf
    for cap in caps:
        layout = build_layout(profile, cap)
        persist, host_state = model_state_bytes(profile, config, layout)
        np_hi = int(_persistent_counts(profile, config, layout, persist, budget)[-1])
        top = _state_top(profile, config, layout)
        ring = int(staging_bytes(layout, planned_state_bytes(profile, config), config.data_parallel_size, 1))
        excess = host_state[np_hi] - host_memory_share(hw)
        k = (config.pins.n_nvme if config.pins.n_nvme is not None else
             0 if excess <= 0 else int(np.searchsorted(top, excess + ring, side="left")))
        if k <= layout.n_chunks - np_hi:
            t_read, t_write = state_io_times(layout, hw, config.data_parallel_size, profile.param_bytes < 4,
                                             speculative_writes(config))
            # On a drive whose reads and writes share its time (cost.time_state_io), both.
            busy = t_write if hw.nvme_duplex else t_read + t_write
            least = min(least, float(busy[layout.n_chunks - k:].sum()))
    return least if np.isfinite(least) else 0.0


def activation_counts(profile: ModelProfile, config: PlannerConfig, hw: HardwareProfile,
                      states_busy: float = 0.0) -> np.ndarray:
    """[A, 4] rows (n_checkpoint, n_swap, n_ssd, n_selective) the search enumerates.

    With the selective mode available (profile.has_selective), the blocks that are neither
    offloaded nor recomputed, the full checkpoints and the selective ones are never all three
    present: per block the three trade memory for time along a line (keep > selective >
    checkpoint in memory, the reverse in time), so the best split of a memory budget over
    them needs at most two kinds - the vertex of the linear program with the block count and
    the memory as its constraints. This keeps the search about three times its size without
    the mode instead of n times."""
    n = profile.n_blocks
    pins = config.pins
    if pins.n_ssd is not None:
        if pins.n_ssd and hw.nvme_write_bandwidth <= 0:
            raise InfeasibleError(f"pinned n_ssd={pins.n_ssd} needs an SSD path for activations "
                                  f"(protrain.ssd_path); set one or pin n_ssd to 0")
        ssds = np.array([pins.n_ssd])
    else:
        ssds = np.arange(min(n, max_ssd_blocks(profile, hw, states_busy)) + 1)
    recompute = "" if not profile.inplace_blocks else (
        f"block {profile.inplace_blocks[0]} changes an input in place in forward (x.add_(...) on "
        f"what it was given), so a recompute would run from the changed input")
    for key in ("n_checkpoint", "n_selective"):
        if recompute and getattr(pins, key):
            raise InfeasibleError(f"pinned {key}={getattr(pins, key)}: {recompute}; pin {key} to 0 "
                                  f"or leave it on auto (no block is recomputed then)")
    if pins.n_selective is not None:
        if pins.n_selective and not profile.has_selective:
            raise InfeasibleError(
                f"pinned n_selective={pins.n_selective}: the selective mode keeps the attention "
                f"operator's outputs, and the profiler saw no attention operator "
                f"(torch.nn.functional.scaled_dot_product_attention) in the model's blocks; pin "
                f"n_selective to 0 or leave it on auto")
        sels = np.array([pins.n_selective])
    else:
        sels = np.arange(n + 1) if profile.has_selective and not recompute else np.array([0])
    ckpts = np.array([pins.n_checkpoint]) if pins.n_checkpoint is not None else \
        np.arange(n + 1) if not recompute else np.array([0])
    nd, nc, nl = (x.ravel() for x in np.meshgrid(ssds, ckpts, sels, indexing="ij"))
    ok = nd + nc + nl <= n
    nd, nc, nl = nd[ok], nc[ok], nl[ok]
    if pins.n_swap is not None:
        ns = np.full(len(nd), pins.n_swap)
    else:
        room = n - nd - nc - nl + 1                       # n_swap in 0..room-1
        # With both recompute kinds, only the n_swap that keeps no block (the filter below).
        every = (nl == 0) | (nc == 0) | (pins.n_selective is not None) | (pins.n_checkpoint is not None)
        count = np.where(every, room, 1)
        rep = np.repeat(np.arange(len(nd)), count)
        ns = np.arange(len(rep)) - np.repeat(np.cumsum(count) - count - np.where(every, 0, room - 1), count)
        nd, nc, nl = nd[rep], nc[rep], nl[rep]
    keep = n - nd - nc - nl - ns
    ok = (keep >= 0) & ((nl == 0) | (nc == 0) | (keep == 0) | (pins.n_selective is not None)
                        | (pins.n_checkpoint is not None))
    out = np.stack([nc, ns, nd, nl], axis=1)[ok].astype(np.int64)
    if not len(out):
        raise InfeasibleError(
            f"pinned n_checkpoint={pins.n_checkpoint}, n_swap={pins.n_swap}, n_ssd={pins.n_ssd} and "
            f"n_selective={pins.n_selective} add up to more than the model's {n} blocks; lower them "
            f"or leave one on auto")
    return out


def candidate_capacities(profile: ModelProfile, config: PlannerConfig) -> tuple[int, ...]:
    """The chunk capacities (elements) to try: the pinned chunk size, else the configured ones
    the model can use; one chunk of every parameter when the framework keeps the model states."""
    if config.pins.chunk_size is not None:
        if config.pins.chunk_size < profile.largest_param * profile.param_bytes:
            raise InfeasibleError(
                f"pinned chunk_size={fmt_bytes(config.pins.chunk_size)} is below the largest "
                f"parameter ({fmt_bytes(profile.largest_param * profile.param_bytes)}); use at least that")
        caps = (config.pins.chunk_size // profile.param_bytes,)
    else:
        caps = chunk_capacities(profile, config.chunk_sizes)
    if config.model_states_fixed is not None:
        caps = (profile.total_params,)      # one chunk, never moved: no chunk knobs to choose
    return caps


def search_floor(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig) -> float:
    """A lower bound on the step time of any plan ``search`` could return for ``profile``,
    from the chunk layouts and the persistent counts that fit alone (``bounds.degree_floor``),
    and the drive's time for the optimizer states every plan keeps there
    (``least_state_drive_time``): milliseconds, where the search builds and bounds every
    point. 0 where the search would refuse the configuration (it says why)."""
    hw = hw.with_limits(device_memory=config.device_memory, host_memory=config.host_memory)
    budget = hw.device_memory / (1.0 + config.memory_margin)
    try:
        floors = []
        caps = candidate_capacities(profile, config)
        for cap in caps:
            layout = build_layout(profile, cap)
            nps = _persistent_counts(profile, config, layout, model_state_bytes(profile, config, layout)[0],
                                     budget)
            floors.append(float(degree_floor(profile, hw, config, layout, nps).min()))
        drive = least_state_drive_time(profile, config, hw, caps, budget)
    except InfeasibleError:
        return 0.0
    return max(min(floors, default=0.0), drive)


_WALK_BATCH = 4096


def activation_configs(profile: ModelProfile, config: PlannerConfig, hw: HardwareProfile,
                       states_busy: float = 0.0) -> ActivationConfigs:
    """Every activation configuration (``activation_counts``) with its activation peak, host
    and NVMe bytes, recompute time and forward's write bound; the checkpointed blocks keep
    their inputs where ``config.pins.ckpt_input`` says (None: on the device; the outer search,
    protrain.search.ckpt_input, pins it)."""
    n = profile.n_blocks
    ckpt_input = config.pins.ckpt_input or "device"
    nc, ns, nd, nl = activation_counts(profile, config, hw, states_busy).T
    # Layout (block_mode.layout_codes): SSD blocks first, then swapped ones, recomputed blocks
    # spread over the rest. Byte sums over those leading ranges are prefix-sum differences.
    saved = np.array([offload_bytes(b) for b in profile.blocks], dtype=np.int64)
    csum = np.concatenate([[0], np.cumsum(saved)])
    ssd, swap_host = csum[nd], csum[nd + ns] - csum[nd]
    # SSD and SWAP free the device alike and leave the same blocks to recompute: walk each
    # (n_checkpoint, n_selective, n_offloaded) once, in batches (long models have many).
    # (one sort of an integer key: the rows of np.unique(axis=0), in its order)
    keys, back = np.unique((nc * (n + 1) + ns + nd) * (n + 1) + nl, return_inverse=True)
    back = back.reshape(-1)
    triples = np.stack([keys // (n + 1) ** 2, keys // (n + 1) % (n + 1), keys % (n + 1)], axis=1)
    fwd = np.array([b.fwd_time for b in profile.blocks])
    sel_t = np.array([b.sel_recompute_time for b in profile.blocks])
    peak = np.empty(len(triples), dtype=np.int64)
    rec = np.zeros(len(triples))
    inputs = np.zeros(len(triples), dtype=np.int64)      # CKPT_HOST / CKPT_SSD blocks' inputs moved
    in_bytes = np.array([ckpt_input_bytes(b) for b in profile.blocks], dtype=np.int64)
    for lo in range(0, len(triples), _WALK_BATCH):
        t = triples[lo:lo + _WALK_BATCH]
        codes = layout_codes(n, t[:, 1], t[:, 0], np.zeros(len(t), dtype=np.int64), t[:, 2],
                             ckpt_input=ckpt_input)
        peak[lo:lo + len(t)] = activation_walk(profile, codes)[0]
        if n:
            rec[lo:lo + len(t)] = full_recompute(codes).astype(np.float64) @ fwd + \
                (codes == SEL).astype(np.float64) @ sel_t
            inputs[lo:lo + len(t)] = np.isin(codes, (CKPT_HOST, CKPT_SSD)).astype(np.int64) @ in_bytes
    on_host, on_drive = (inputs[back], 0) if ckpt_input == "host" else (0, inputs[back]) \
        if ckpt_input == "drive" else (0, 0)
    fwd_chain, bwd_chain = _chains(profile, hw, nc, ns, nd, nl, rec[back])
    return ActivationConfigs(
        n_blocks=n, n_ckpt=nc, n_swap=ns, n_ssd=nd, n_sel=nl, act_peak=peak[back],
        swap_host=swap_host + on_host, ssd=ssd + on_drive, recompute=rec[back],
        fwd_write=fwd_chain,
        bwd_read=bwd_chain, ckpt_input=ckpt_input)


def _chains(profile: ModelProfile, hw: HardwareProfile, nc, ns, nd, nl, rec):
    """(forward, backward) of ``bounds.activation_chains`` for every configuration, from one
    chain per key: the layout puts the SSD and swapped blocks first and recomputes only blocks
    above them, so forward's chain depends on the two counts alone, and backward's is the
    compute of the parts above those blocks (with their recompute) plus what the first of
    them adds, the same for every configuration of one (n_ssd, n_swap, mode of the block above
    them) (the model is max-plus: shifting its inputs shifts its times). Each key's chain runs
    on a layout of its offloaded blocks and that block alone recomputed. The checkpointed
    blocks' input copies (``ckpt_input`` host / drive) are left out of the chains: a bound
    still, for the same reason. A 70B model has 187 k configurations, 1.8 k (n_ssd, n_swap)
    and 5.5 k keys."""
    n = profile.n_blocks
    if not n:
        return (np.full(len(nc), sum(p.fwd_time for p in profile.parts)),
                sum(p.bwd_time for p in profile.parts) + rec)
    first = nd + ns
    j = np.arange(n)[None, :]

    def layouts(d, f, mode):
        codes = np.where(j < d[:, None], SSD, np.where(j < f[:, None], SWAP, NONE)).astype(np.int8)
        codes[j == f[:, None]] = np.broadcast_to(mode[:, None], codes.shape)[j == f[:, None]]
        return codes

    pair = first * (n + 1) + nd
    uniq, pair_of = _dedupe(pair, (n + 1) ** 2)
    fwd = forward_chain(profile, hw, layouts(uniq % (n + 1), uniq // (n + 1), np.zeros(len(uniq), np.int8)))
    # The block above the offloaded ones is the first recomputed (``layout_codes``): fully
    # where any is (its input kept on the device here), else selectively.
    mode = np.where((first >= n) | (nc + nl == 0), NONE, np.where(nc > 0, CKPT, SEL)).astype(np.int64)
    uniq, key_of = _dedupe(pair * 8 + mode, (n + 1) ** 2 * 8)
    d, f, m = uniq // 8 % (n + 1), uniq // 8 // (n + 1), (uniq % 8).astype(np.int8)
    bwd = backward_chain(profile, hw, layouts(d, f, m))
    # Backward's compute from the block above the offloaded ones on (the post part when none is).
    parts = list(profile.block_part_indices) + [profile.block_part_indices[-1] + 1]
    bwd_from = np.concatenate([np.cumsum([p.bwd_time for p in profile.parts][::-1])[::-1], [0.0]])
    redo = np.array([[0.0, b.fwd_time, 0.0, 0.0, b.sel_recompute_time] for b in profile.blocks] + [[0.0] * 5])
    above_key = bwd_from[np.asarray(parts)[f]] + redo[f, m]
    return fwd[pair_of], bwd_from[np.asarray(parts)[first]] + rec + (bwd - above_key)[key_of]


def _dedupe(keys: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct ``keys``, ascending; each key's index among them): small non-negative
    integer keys, without a sort."""
    seen = np.zeros(size, dtype=bool)
    seen[keys] = True
    uniq = np.flatnonzero(seen)
    index = np.zeros(size, dtype=np.int64)
    index[uniq] = np.arange(len(uniq))
    return uniq, index[keys]


def candidate_grid(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig,
                   acts: ActivationConfigs, chunk_numel: int, budget: float, stats: dict) -> CandidateGrid:
    """The points of chunks of ``chunk_numel`` elements that fit ``budget`` (device bytes, the
    margin taken off), the host memory and the drive, with their lower bounds and bytes moved.
    ``stats`` gathers what the nearest misses needed (``host_needed``, ``buffers_needed``)
    over the chunk sizes, for the diagnosis when nothing fits. Every point at once: the search
    fits its pairs as their bounds reach them (``search.pairs``); tests compare against this."""
    layout = build_layout(profile, chunk_numel)
    fits, nps = _fitting_configs(profile, hw, config, acts, layout, budget)
    # In blocks of configurations (each with every n_persist), in the grid's order: every
    # column is elementwise over the points, and a block's temporaries stay in the cache.
    step = max(1, _BLOCK // len(nps))
    seen = new_seen()
    blocks = [_grid_block(profile, hw, config, acts, layout, budget, stats, seen, fits[lo:lo + step], nps)
              for lo in range(0, max(len(fits), 1), step)]
    note_buffers(config, seen, stats)
    return CandidateGrid(layout, *(np.concatenate([b[k] for b in blocks]) for k in range(13)))


def new_seen() -> dict:
    """What ``_fitting_points`` gathers over a grid's blocks for ``note_buffers``."""
    return dict(any_buffers=False, least_buffers=1 << 30)


def note_buffers(config: PlannerConfig, seen: dict, stats: dict) -> None:
    """Into ``stats`` (the diagnosis's): the fewest buffers a point of a grid needs, where a
    pinned n_buffer is below every point's least (``seen``: gathered by ``_fitting_points``)."""
    if config.pins.n_buffer is not None and seen["least_buffers"] < 1 << 30 and not seen["any_buffers"]:
        stats["buffers_needed"] = min(stats.get("buffers_needed", 1 << 30), seen["least_buffers"])


def grid_of_pairs(profile, hw, config, acts: ActivationConfigs, layout, budget: float, stats: dict,
                  seen: dict, a_idx: np.ndarray, np_idx: np.ndarray) -> CandidateGrid:
    """``candidate_grid`` for the points (``a_idx``, ``np_idx``) alone (``pairs.fit_pairs``)."""
    blocks = [_grid_columns(profile, hw, config, acts, layout, budget, stats, seen,
                            a_idx[lo:lo + _BLOCK], np_idx[lo:lo + _BLOCK])
              for lo in range(0, max(len(a_idx), 1), _BLOCK)]
    return CandidateGrid(layout, *(np.concatenate([b[k] for b in blocks]) for k in range(13)))


_BLOCK = 1 << 16
"""Points of a candidate grid computed together (``candidate_grid``)."""


def _grid_block(profile, hw, config, acts: ActivationConfigs, layout, budget: float, stats: dict,
                seen: dict, fits: np.ndarray, nps: np.ndarray) -> tuple:
    """The columns of ``CandidateGrid`` (after the layout) for the points of configurations
    ``fits`` x ``nps`` that fit."""
    a_idx, np_idx = (x.ravel() for x in np.meshgrid(fits, nps, indexing="ij"))
    return _grid_columns(profile, hw, config, acts, layout, budget, stats, seen, a_idx, np_idx)


def _grid_columns(profile, hw, config, acts: ActivationConfigs, layout, budget: float, stats: dict,
                  seen: dict, a_idx: np.ndarray, np_idx: np.ndarray) -> tuple:
    """``_grid_block`` for the points (``a_idx``, ``np_idx``)."""
    a_idx, np_idx, nb, nbmin, peak, host, nv, ns = _fitting_points(profile, hw, config, acts, layout, budget,
                                                                   stats, seen, a_idx, np_idx)
    bound = step_lower_bound(profile, hw, config, acts, layout, a_idx, np_idx, nb, host, nv, n_shard=ns)
    lb, fwd_lb, dev_lb, tail_lb = (np.broadcast_to(x, np.shape(a_idx)) for x in bound)
    # Bytes per micro-step: offloaded chunks up in forward and their gradients down; chunks
    # not among the last n_buffer up again in backward; swapped and NVMe activations out
    # and back in (cost.time_model counts the same); per step, the states on the drive read
    # and written back.
    ub = chunk_bytes_prefix(layout, profile, config)
    moved = config.grad_accumulation_steps * (
        2.0 * (ub[layout.n_chunks] - ub[np_idx]) + reupload_bytes(layout, profile, config, np_idx, nb) +
        2.0 * (acts.swap_host[a_idx] + acts.ssd[a_idx])) + _state_io_top(profile, config, layout)[nv]
    return a_idx, np_idx, nb, nbmin, peak, host, lb, fwd_lb, dev_lb, tail_lb, moved, nv, ns


def most_buffers(config: PlannerConfig, rem, buf: int, offloaded) -> np.ndarray:
    """Per point: the pinned n_buffer, else the most buffers of ``buf`` bytes that ``rem``
    device bytes hold, at most the ``offloaded`` chunks (more buffers never delay anything)."""
    if config.pins.n_buffer is not None:
        return np.full(np.shape(offloaded), config.pins.n_buffer, dtype=np.int64)
    return np.minimum(np.maximum(np.floor(np.maximum(rem, -1) / buf).astype(np.int64), 0), offloaded)


def model_state_bytes(profile: ModelProfile, config: PlannerConfig, layout) -> tuple[np.ndarray, np.ndarray]:
    """(device bytes of the persistent chunks, host bytes of the offloaded ones' states), per
    n_persist from 0 to n_chunks."""
    sb = planned_state_bytes(profile, config)
    world = config.data_parallel_size
    prefix = np.concatenate([[0], np.cumsum(layout.used, dtype=np.int64)])
    shard = np.concatenate([[0], np.cumsum([-(-u // world) for u in layout.used], dtype=np.int64)])
    if config.model_states_fixed is not None:
        # Activations only: the framework keeps every model state on the device itself.
        return (np.full(layout.n_chunks + 1, config.model_states_fixed, dtype=np.int64),
                np.zeros(layout.n_chunks + 1, dtype=np.int64))
    return prefix * sb.persistent, (shard[-1] - shard) * sb.host


def _persistent_counts(profile: ModelProfile, config: PlannerConfig, layout, persist: np.ndarray,
                       budget: float) -> np.ndarray:
    """The n_persist values to try: the pin, else from the layout's least (chunks that must
    stay) to the most whose persistent chunks alone fit ``budget`` (sharded where plans shard:
    ``sharding.least_device_states``)."""
    pins = config.pins
    nch = layout.n_chunks
    lo = layout.min_persist
    if config.model_states_fixed is not None or pins.n_persist == ALL:
        return np.array([nch])
    if pins.n_persist is not None:
        if pins.n_persist > nch:
            raise InfeasibleError(f"pinned n_persist={pins.n_persist} exceeds the {nch} chunks of "
                                  f"{fmt_bytes(layout.chunk_bytes)}; use at most {nch}, or \"all\" "
                                  f"to keep every chunk on the device")
        if pins.n_persist < lo:
            why = why_persistent(profile.params, layout, tuple(p.name for p in profile.parts))
            raise InfeasibleError(f"pinned n_persist={pins.n_persist} is below {lo}: {why}. A chunk "
                                  f"used by parts that are not adjacent must stay on the device "
                                  f"(reloading it in between would split its gradient), and so "
                                  f"must the chunks before it; pin n_persist >= {lo}, or leave it "
                                  f"on auto")
        return np.array([pins.n_persist])
    # Persistent chunks alone must fit, which bounds the range long before n_chunks.
    hi = int(np.searchsorted(least_device_states(profile, config, layout, persist), budget, side="right")) - 1
    return np.arange(lo, max(lo, min(hi, nch)) + 1)


def _fitting_configs(profile, hw, config, acts: ActivationConfigs, layout, budget: float):
    """(activation configurations, n_persist counts) whose points may fit: the configurations
    that fit next to the fewest persistent chunks and on the drive (exact: more chunks or
    buffers only add; long sequences leave few)."""
    persist = model_state_bytes(profile, config, layout)[0]
    nps = _persistent_counts(profile, config, layout, persist, budget)
    drive_room = nvme_free_share(hw) / (1.0 + config.memory_margin)
    space = activation_file_space(acts.ssd, profile.n_blocks)
    least = least_device_states(profile, config, layout, persist)
    return np.flatnonzero((acts.act_peak + least[nps[0]] <= budget) & (space <= drive_room)), nps


def _fitting_points(profile, hw, config, acts: ActivationConfigs, layout, budget: float, stats: dict,
                    seen: dict, a_idx: np.ndarray, np_idx: np.ndarray):
    """(activation configuration, n_persist, n_buffer, least n_buffer, device peak, host
    bytes, n_nvme, n_shard) of the points (``a_idx``, ``np_idx``) that fit, each with the
    fewest sharded chunks with which it fits (``sharding.fewest_sharded``), the most buffers
    that fit then and the fewest chunks with states on the drive that fit the host
    (``_drive_states``). ``seen`` gathers over the blocks of a grid whether any point has a
    pinned n_buffer's least buffers, and the fewest any needs."""
    pins = config.pins
    nch = layout.n_chunks
    persist, host_state = model_state_bytes(profile, config, layout)
    buf = buffer_numel(layout, config.data_parallel_size) * planned_state_bytes(profile, config).buffer
    scratch = norm_scratch(profile, config, layout)
    drive_room = nvme_free_share(hw) / (1.0 + config.memory_margin)
    rem = budget - acts.act_peak[a_idx] - persist[np_idx] - scratch[np_idx]
    nbmin = layout.min_buffers_table()[np_idx]
    nb = most_buffers(config, rem, buf, nch - np_idx)
    room = budget - acts.act_peak[a_idx] - scratch[np_idx]
    ns = fewest_sharded(profile, config, layout, persist, buf, room, np_idx,
                        (nb * buf <= rem) & (nb >= nbmin) & (nb <= nch - np_idx))
    most = most_sharded(config, layout, np_idx)
    if pins.n_shard is None and (most > ns).any():
        # Each point also with the most sharded (device Adam on 1/world of them, and the gathers
        # on the copy queues, which compute may hide): which is faster is the simulation's call.
        twin = np.flatnonzero(most > ns)
        rows = np.concatenate([np.arange(len(np_idx)), twin])
        a_idx, np_idx, rem, nbmin, nb, room = (x.take(rows) for x in (a_idx, np_idx, rem, nbmin, nb, room))
        ns = np.concatenate([ns, most.take(twin)])
    states, rep = persist[np_idx], np_idx
    if ns.any():
        rep = np_idx - ns
        ok = rep >= layout.min_persist
        rep = np.where(ok, rep, np_idx)               # (dropped below)
        sharded = sharded_state_bytes(layout, planned_state_bytes(profile, config), config.data_parallel_size)
        states = np.where(ok, persist[rep] + sharded[np_idx] - sharded[rep], np.iinfo(np.int64).max // 4)
        nbmin = layout.min_buffers_table()[rep]
        nb = most_buffers(config, room - states, buf, nch - rep)
    peak = acts.act_peak[a_idx] + states + nb * buf + scratch[np_idx]
    if pins.n_buffer is not None and len(nbmin):
        seen["any_buffers"] |= bool((nb >= nbmin).any())
        seen["least_buffers"] = min(seen["least_buffers"], int(nbmin.min()))
    # Buffers beyond the offloaded and sharded chunks would hold nothing (a pinned n_buffer
    # then caps n_persist); at least the chunks one part spans are needed.
    dev_ok = np.flatnonzero((peak <= budget) & (nb >= nbmin) & (nb <= nch - rep))
    a_idx, np_idx, nb, nbmin, peak, ns = (x.take(dev_ok) for x in (a_idx, np_idx, nb, nbmin, peak, ns))
    host = host_state[np_idx] + acts.swap_host[a_idx]
    nv, host, drive = _drive_states(profile, hw, config, layout, np_idx, host,
                                    activation_file_space(acts.ssd[a_idx], profile.n_blocks), stats)
    ok = (host <= host_memory_share(hw)) & (nv <= nch - np_idx) & (drive <= drive_room)
    return tuple(x.take(np.flatnonzero(ok)) for x in (a_idx, np_idx, nb, nbmin, peak, host, nv, ns))


def _state_io_top(profile, config, layout) -> np.ndarray:
    """Bytes of optimizer states the last k chunks read from the drive and write back, at index k."""
    sb = planned_state_bytes(profile, config)
    world = config.data_parallel_size
    return nvme_state_top(layout, sb, world) + nvme_state_top(layout, sb, world, staged=True)


def _state_top(profile, config, layout) -> np.ndarray:
    """Bytes of optimizer states of the last k chunks' shards, at index k."""
    return nvme_state_top(layout, planned_state_bytes(profile, config), config.data_parallel_size)


def _drive_states(profile, hw, config, layout, np_idx, host, ssd, stats: dict):
    """(n_nvme, host bytes, drive bytes) of each point: the pin, else the fewest chunks with
    their optimizer states on the drive that bring the host bytes within the host memory
    (none where they fit already, or without a drive). ``drive``: what one rank puts on the
    drive, activations and the state file (``cost.memory.nvme_file_top``).

    The fewest is the fastest of the counts that fit, the rest of the point held equal: a
    chunk moved to the drive keeps its CPU Adam work, and adds the read before its update and
    the write-back after it (cost.time_state_io: they only delay the update, and add to the
    drive's floor); its gradients, parameters, uploads and device memory are unchanged. The
    one thing a count could gain is speculation (clipping / fp16): a chunk on the drive
    speculates without a backup, and frees host memory for the others' backups. The search
    leaves that to the hedge (``PlannerConfig.time_tolerance``): every further chunk moves
    twice its states' bytes through the drive per step more, so it would be chosen only if
    faster by more than the model's error band - a gain the model cannot tell from its
    error. Without speculation the fewest is exactly the fastest (each step of the argument
    above is monotone in the simulation), and ties go to fewer bytes moved anyway."""
    sb = planned_state_bytes(profile, config)
    world = config.data_parallel_size
    top = _state_top(profile, config, layout)
    ring = int(staging_bytes(layout, sb, world, 1))
    pin = config.pins.n_nvme
    if pin and not drive_states_possible(config, hw):
        raise InfeasibleError(
            f"pinned n_nvme={pin} puts optimizer states on the drive, but "
            + ("the framework keeps the model states here (activations only); pin n_nvme to 0"
               if config.model_states_fixed is not None else
               "no drive is configured: set ssd_path (protrain.ssd_path; protrain plan --nvme GB/s) "
               "or pin n_nvme to 0"))
    # A pinned speculate_chunks: its chunks' backups are host memory the plan holds too, but
    # not those of chunks on the drive (they speculate into their other place there).
    spec = pinned_speculation(layout, config, np_idx)
    backups = backup_from_top(layout, world)
    if pin is not None:
        nv = np.full_like(np_idx, pin)
    elif drive_states_possible(config, hw):
        nv = _fewest_on_drive(host + backups[spec] - host_memory_share(hw), top, ring, backups, spec)
    else:
        nv = np.zeros_like(np_idx)
    # Beyond the offloaded chunks (refused by the caller) the host is the least it can be.
    nv_c = np.minimum(nv, layout.n_chunks - np_idx)
    held_backups = backups[spec] - backups[np.minimum(spec, nv_c)]
    host = host - top[nv_c] + np.where(nv_c > 0, ring, 0) + held_backups
    if len(host) and host.min() < stats.get("host_needed", np.inf):
        i = int(host.argmin())
        stats["host_needed"], stats["host_backups"] = host[i], held_backups[i]
    drive = ssd + nvme_file_top(layout, sb, world)[nv_c]
    fit = (host <= host_memory_share(hw)) & (nv <= layout.n_chunks - np_idx)
    if fit.any() and (drive[fit] > 0).any():
        need = drive[fit].min()
        stats["drive_needed"] = min(stats.get("drive_needed", need), need)
    return nv, host, drive


def _fewest_on_drive(excess: np.ndarray, top: np.ndarray, ring: int, backups: np.ndarray,
                     spec: np.ndarray) -> np.ndarray:
    """Per point: the fewest last chunks whose states, moved to the drive, take ``excess`` host
    bytes off (0 where none is over): each takes its states off, and its backup where it is
    among the ``spec`` pinned speculating chunks; the first one adds the staging ring."""
    nv = np.zeros_like(spec)
    over = excess > 0
    for s in np.unique(spec[over]):
        rows = over & (spec == s)
        gain = top + backups[np.minimum(np.arange(len(top)), s)]
        nv[rows] = np.searchsorted(gain, excess[rows] + ring, side="left")
    return nv


def chunk_bytes_prefix(layout, profile, config) -> np.ndarray:
    """Bytes one rank copies for chunks [0, c), at index c."""
    return np.concatenate([[0.0], np.cumsum(np.asarray(layout.used, dtype=np.float64) *
                                            profile.param_bytes / config.data_parallel_size)])


def reupload_bytes(layout, profile, config, n_persist, n_buffer) -> np.ndarray:
    """Bytes of the offloaded chunks uploaded again in backward (not among the last n_buffer)."""
    ub = chunk_bytes_prefix(layout, profile, config)
    return ub[np.maximum(layout.n_chunks - np.asarray(n_buffer), n_persist)] - ub[n_persist]
