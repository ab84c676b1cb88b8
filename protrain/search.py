"""Search: the fastest plan that fits the device and host budgets.

Exhaustive over chunk size, n_persist, n_checkpoint and n_swap; exact over n_buffer through a
property of the runtime model (more buffers never delay anything), so each point takes the
most buffers that still fit, and only ties are re-checked with fewer. Points are evaluated in
order of a lower bound on their iteration time (compute alone, each copy queue alone, the CPU
optimizer alone) and the search stops when no remaining bound can beat the best time found:
the answer equals a brute-force search over all five knobs (tests check it), in a fraction of
its time.

The search hedges against the cost model's own error: every plan predicted within
``PlannerConfig.time_tolerance`` of the fastest counts as equally fast, and among those the one
that moves the fewest bytes per step (host <-> device, NVMe) wins - a difference the model
cannot resolve is no reason to take on transfers whose overlap it may have overrated. Then
the faster, then the lower peak. The plan's notes say when this changed the choice.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from .block_mode import CKPT, SEL, BlockMode, layout_block_modes, layout_codes, modes_string, same_counts
from .config import ALL, KNOB_NAMES, PlannerConfig
from .layout import ChunkLayout, build_layout, chunk_capacities, why_persistent
from .cost.predicted_timeline import predicted_timeline
from .cost.memory import (activation_walk, buffer_numel, norm_scratch_bytes, offload_bytes, predict_memory,
                          state_bytes)
from .cost.host_share import rank_rates
from .cost.runtime import backup_times, check_times, chunk_transfer_times, persistent_allreduce_time, simulate
from .plan import Alternative, ChunkSummary, Knobs, Plan, Prediction
from .profile.hardware import HardwareProfile
from .profile.model_profile import ModelProfile
from .units import fmt_bytes, fmt_seconds

_BATCH = 2048
_SWEEP = 128
"""Buffer counts per point tried in one round of the tie refinement (``search``)."""
EXACT_SIMULATIONS = 8192
"""Simulations after which the search accepts a plan within ``TIE_TOLERANCE`` of the best
unsimulated bound instead of simulating every near-tie. Models whose step is bound by one
resource (CPU Adam on a 70B model) have tens of thousands of plans within a few milliseconds
of each other; below this count the answer is exactly the brute-force one."""
TIE_TOLERANCE = 1e-4
"""Relative time the unsimulated plans may still gain when the search stops early."""


class InfeasibleError(RuntimeError):
    """No plan fits. The message says what would fit and what to change."""

    def __init__(self, message: str, *, device_needed: int | None = None,
                 host_needed: int | None = None, micro_batch_fit: int | None = None):
        super().__init__(message)
        self.device_needed = device_needed
        self.host_needed = host_needed
        self.micro_batch_fit = micro_batch_fit


# How far above the best time a lower bound may lie and still be simulated: a bound is summed
# in another order than the simulation, so a plan tied with the best can have a bound a
# rounding error above it.
BOUND_ROUNDING = 1e-9


def plan_key(iter_time: float, peak: int, knobs: tuple) -> tuple:
    """Order between plans the model tells apart: faster, then smaller peak, then smaller knobs."""
    return (iter_time, peak, knobs)


def hedged_key(moved: float, iter_time: float, peak: int, knobs: tuple) -> tuple:
    """Order between plans within the error band of the fastest: fewer bytes moved per step,
    then ``plan_key``."""
    return (moved,) + plan_key(iter_time, peak, knobs)


def bytes_moved(t, micro, gas: int, ssd: np.ndarray, hw: HardwareProfile) -> np.ndarray:
    """Bytes moved per optimizer step by simulated plans (``t``: the boundary micro-step's
    TimePrediction, ``micro``: the accumulating one's or None): host <-> device copies, and
    the NVMe traffic (written and read back) that does not pass through them (GPUDirect).
    The search computes the same in closed form (``_Grid.moved``)."""
    per = lambda x: x.h2d_bytes + x.d2h_bytes + (2.0 * ssd if hw.nvme_gds else 0.0)  # noqa: E731
    return per(t) + ((gas - 1) * per(micro) if micro is not None else 0.0)


@dataclass
class _ActivationConfigs:
    """Every (n_checkpoint, n_swap, n_ssd, n_selective) the search may use, with what depends
    only on them. The block layouts themselves are built only for the configurations
    simulated."""

    n_blocks: int
    n_ckpt: np.ndarray
    n_swap: np.ndarray
    n_ssd: np.ndarray
    n_sel: np.ndarray
    act_peak: np.ndarray       # [A] bytes
    swap_host: np.ndarray      # [A] bytes
    ssd: np.ndarray            # [A] bytes written to NVMe per iteration
    recompute: np.ndarray      # [A] seconds of recompute in backward
    fwd_write: np.ndarray      # [A] seconds forward cannot beat: its swap / SSD write queues

    def codes(self, a: np.ndarray) -> np.ndarray:
        """[len(a), n_blocks] mode codes of configurations ``a``."""
        return layout_codes(self.n_blocks, self.n_swap[a], self.n_ckpt[a], self.n_ssd[a], self.n_sel[a])


def max_ssd_blocks(profile: ModelProfile, hw: HardwareProfile) -> int:
    """SSD blocks worth considering: the leading blocks whose writes the drive can absorb
    within one iteration's compute (SSDTrain's adaptive amount, bounded more loosely). More
    would make the drive the bottleneck; CKPT and SWAP remain for the memory beyond that."""
    if hw.nvme_write_bandwidth <= 0 or hw.nvme_read_bandwidth <= 0:
        return 0
    budget = sum(p.fwd_time + p.bwd_time for p in profile.parts)
    total, n = 0.0, 0
    for b in profile.blocks:
        total += offload_bytes(b) / hw.nvme_write_bandwidth
        if total > budget:
            break
        n += 1
    return n


def activation_counts(profile: ModelProfile, config: PlannerConfig, hw: HardwareProfile) -> np.ndarray:
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
        ssds = np.arange(min(n, max_ssd_blocks(profile, hw)) + 1)
    if pins.n_selective is not None:
        if pins.n_selective and not profile.has_selective:
            raise InfeasibleError(
                f"pinned n_selective={pins.n_selective}: the selective mode keeps the attention "
                f"operator's outputs, and the profiler saw no attention operator "
                f"(torch.nn.functional.scaled_dot_product_attention) in the model's blocks; pin "
                f"n_selective to 0 or leave it on auto")
        sels = np.array([pins.n_selective])
    else:
        sels = np.arange(n + 1) if profile.has_selective else np.array([0])
    ckpts = np.array([pins.n_checkpoint]) if pins.n_checkpoint is not None else np.arange(n + 1)
    nd, nc, nl = (x.ravel() for x in np.meshgrid(ssds, ckpts, sels, indexing="ij"))
    ok = nd + nc + nl <= n
    nd, nc, nl = nd[ok], nc[ok], nl[ok]
    if pins.n_swap is not None:
        ns = np.full(len(nd), pins.n_swap)
    else:
        room = n - nd - nc - nl + 1                       # n_swap in 0..room-1
        rep = np.repeat(np.arange(len(nd)), room)
        ns = np.arange(len(rep)) - np.repeat(np.cumsum(room) - room, room)
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


_WALK_BATCH = 4096


def _activation_configs(profile: ModelProfile, config: PlannerConfig,
                        hw: HardwareProfile) -> _ActivationConfigs:
    n = profile.n_blocks
    nc, ns, nd, nl = activation_counts(profile, config, hw).T
    # Layout (block_mode.layout_codes): SSD blocks first, then swapped ones, recomputed blocks
    # spread over the rest. Byte sums over those leading ranges are prefix-sum differences.
    saved = np.array([offload_bytes(b) for b in profile.blocks], dtype=np.int64)
    csum = np.concatenate([[0], np.cumsum(saved)])
    ssd, swap_host = csum[nd], csum[nd + ns] - csum[nd]
    # SSD and SWAP free the device alike and leave the same blocks to recompute: walk each
    # (n_checkpoint, n_selective, n_offloaded) once, in batches (long models have many).
    triples, back = np.unique(np.stack([nc, ns + nd, nl], axis=1), axis=0, return_inverse=True)
    back = back.reshape(-1)
    fwd = np.array([b.fwd_time for b in profile.blocks])
    sel_t = np.array([b.sel_recompute_time for b in profile.blocks])
    peak = np.empty(len(triples), dtype=np.int64)
    rec = np.zeros(len(triples))
    for lo in range(0, len(triples), _WALK_BATCH):
        t = triples[lo:lo + _WALK_BATCH]
        codes = layout_codes(n, t[:, 1], t[:, 0], np.zeros(len(t), dtype=np.int64), t[:, 2])
        peak[lo:lo + len(t)] = activation_walk(profile, codes)[0]
        if n:
            rec[lo:lo + len(t)] = (codes == CKPT).astype(np.float64) @ fwd + \
                (codes == SEL).astype(np.float64) @ sel_t
    return _ActivationConfigs(
        n_blocks=n, n_ckpt=nc, n_swap=ns, n_ssd=nd, n_sel=nl, act_peak=peak[back],
        swap_host=swap_host, ssd=ssd, recompute=rec[back],
        fwd_write=_forward_write_bound(profile, hw, csum, ns, nd))


def _forward_write_bound(profile: ModelProfile, hw: HardwareProfile, csum: np.ndarray,
                         n_swap: np.ndarray, n_ssd: np.ndarray) -> np.ndarray:
    """A lower bound on the end of forward from the activation writes (cost.runtime): part
    p >= 2 waits for the write of block part p - 2, so the post part starts after every write
    queued for the blocks before the last one (writes of one queue run one after another).
    SWAP writes use the D2H queue; SSD writes have their own queue under GPUDirect Storage and
    share the D2H queue in compatibility mode. ``csum``: prefix sums of the blocks' saved
    bytes."""
    n = profile.n_blocks
    if n < 2:
        return np.zeros(len(n_swap))
    head = lambda k: csum[np.minimum(k, n - 1)]      # noqa: E731 - bytes of blocks < k, last excluded
    d2h = rank_rates(hw).d2h
    swap = (head(n_ssd + n_swap) - head(n_ssd)) / d2h
    if hw.nvme_write_bandwidth > 0:
        bw = hw.nvme_write_bandwidth if hw.nvme_gds else min(hw.nvme_write_bandwidth, d2h)
        ssd = head(n_ssd) / bw
    else:
        ssd = np.zeros(len(n_swap))
    writes = np.maximum(swap, ssd) if hw.nvme_gds else swap + ssd
    return np.where(writes > 0, writes + profile.parts[-1].fwd_time, 0.0)


@dataclass
class _Grid:
    """Feasible (activation config, n_persist) points of one chunk size, with derived n_buffer."""

    layout: ChunkLayout
    a: np.ndarray
    n_persist: np.ndarray
    n_buffer: np.ndarray
    n_buffer_min: np.ndarray
    peak: np.ndarray
    host: np.ndarray
    lower_bound: np.ndarray
    fwd_lb: np.ndarray
    """Parts of the lower bound, for ``_refine_cpu_bound``: forward, the device's backward and
    optimizer, and the accumulation micro-steps."""
    dev_lb: np.ndarray
    tail_lb: np.ndarray
    moved: np.ndarray
    """Bytes moved per optimizer step (exact: what the simulation counts)."""


def _grid(profile, hw, config, acts: _ActivationConfigs, chunk_numel: int, budget: float,
          stats: dict) -> _Grid:
    layout = build_layout(profile, chunk_numel)
    pins = config.pins
    nch = layout.n_chunks
    sb = _state_bytes(profile, config)
    world = config.data_parallel_size
    prefix = np.concatenate([[0], np.cumsum(layout.used, dtype=np.int64)])
    shard = np.concatenate([[0], np.cumsum([-(-u // world) for u in layout.used], dtype=np.int64)])
    persist = prefix * sb.persistent
    host_state = (shard[-1] - shard) * sb.host
    if config.model_states_fixed is not None:
        # Activations only: the framework keeps every model state on the device itself.
        persist = np.full(nch + 1, config.model_states_fixed, dtype=np.int64)
        host_state = np.zeros(nch + 1, dtype=np.int64)
    buf = buffer_numel(layout, world) * sb.buffer
    nbmin_table = layout.min_buffers_table()
    scratch = _norm_scratch(profile, config, layout)

    lo = layout.min_persist
    if config.model_states_fixed is not None:
        nps = np.array([nch])
    elif pins.n_persist == ALL:
        nps = np.array([nch])
    elif pins.n_persist is not None:
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
        nps = np.array([pins.n_persist])
    else:
        # Persistent chunks alone must fit, which bounds the range long before n_chunks.
        hi = int(np.searchsorted(persist, budget, side="right")) - 1
        nps = np.arange(lo, max(lo, min(hi, nch)) + 1)
    # Activation configurations that fit next to the fewest persistent chunks and on the drive
    # (exact: more chunks or buffers only add); long sequences leave few.
    fits = np.flatnonzero((acts.act_peak + persist[nps[0]] <= budget)
                          & (acts.ssd <= hw.nvme_free_bytes / (1.0 + config.memory_margin)))
    a_idx, np_idx = (x.ravel() for x in np.meshgrid(fits, nps, indexing="ij"))
    rem = budget - acts.act_peak[a_idx] - persist[np_idx] - scratch[np_idx]
    nbmin = nbmin_table[np_idx]
    if pins.n_buffer is not None:
        nb = np.full_like(np_idx, pins.n_buffer)
    else:
        nb = np.clip(np.floor(np.maximum(rem, -1) / buf).astype(np.int64), 0, nch - np_idx)
    peak = acts.act_peak[a_idx] + persist[np_idx] + nb * buf + scratch[np_idx]
    host = host_state[np_idx] + acts.swap_host[a_idx]
    disk_ok = acts.ssd[a_idx] <= hw.nvme_free_bytes / (1.0 + config.memory_margin)
    # Buffers beyond the offloaded chunks would hold nothing (a pinned n_buffer then caps
    # n_persist); at least the chunks one part spans are needed.
    dev_ok = (peak <= budget) & (nb >= nbmin) & (nb <= nch - np_idx)
    host_ok = (host <= hw.host_memory) & disk_ok
    if dev_ok.any():
        need = host[dev_ok].min()
        stats["host_needed"] = min(stats.get("host_needed", need), need)
    if pins.n_buffer is not None and len(nbmin) and not (nb >= nbmin).any():
        stats["buffers_needed"] = min(stats.get("buffers_needed", 1 << 30), int(nbmin.min()))
    ok = dev_ok & host_ok
    a_idx, np_idx, nb, nbmin, peak, host = (x[ok] for x in (a_idx, np_idx, nb, nbmin, peak, host))

    # Lower bound on the time of an optimizer step: each resource alone (see cost.runtime
    # for the queues), for the boundary micro-step and for the (gas - 1) others.
    t_up, t_down, t_adam = chunk_transfer_times(layout, profile, hw, world)
    rr = rank_rates(hw)
    up_suffix = np.concatenate([np.cumsum(t_up[::-1])[::-1], [0.0]])      # sum_{c>=n} t_up
    down_suffix = np.concatenate([np.cumsum(t_down[::-1])[::-1], [0.0]])
    adam_suffix = np.concatenate([np.cumsum(t_adam[::-1])[::-1], [0.0]])
    fwd_compute = sum(p.fwd_time for p in profile.parts)
    bwd_compute = sum(p.bwd_time for p in profile.parts) + acts.recompute[a_idx]
    swap_bytes = acts.swap_host[a_idx]
    gpu = prefix[np_idx] / rr.device_adam + persistent_allreduce_time(layout, np_idx, hw, world)
    fwd_lb = np.maximum(np.maximum(fwd_compute, up_suffix[np_idx]), acts.fwd_write[a_idx])
    reup = up_suffix[np_idx] - up_suffix[np.maximum(nch - nb, np_idx)]
    ssd_in = acts.ssd[a_idx] / hw.nvme_read_bandwidth if hw.nvme_read_bandwidth > 0 else 0.0
    if hw.nvme_gds:
        bwd_lb = np.maximum(np.maximum(bwd_compute, reup + swap_bytes / rr.h2d), ssd_in)
    else:   # bounced through the host: on the upload queue with the chunk re-uploads
        bwd_lb = np.maximum(bwd_compute, reup + swap_bytes / rr.h2d + ssd_in)
    adam = adam_suffix[np_idx]
    if _weak_cpu_bound(config, hw):
        # Updates left for after backward run on into the next forward (cost.runtime's
        # carry_over): the step is at least the device's work and at least CPU Adam's, with
        # the verdict checks when there are (clipping / fp16).
        checks = _host_checks(layout, hw, config, np_idx)
        cpu_lb = adam + checks - fwd_lb
        if not config.cpu_optim_overlap:
            vb = _VerdictBound(profile, layout, hw, config, np_idx,
                               _backward_bound(profile, layout, hw, world, np_idx, nb, bwd_lb), checks)
            s_max = _speculation_max(layout, hw, config, np_idx, host)
            cpu_lb = np.maximum(cpu_lb, (vb.at(s_max) if config.speculate_chunks is not None
                                         else vb.least(s_max)) - fwd_lb)
    elif config.cpu_optim_overlap:
        # CPU Adam starts at the earliest once the last chunk's gradient is complete (after
        # the backward of the parts from its first user on) and has left the device.
        first = layout.chunk_first_part[nch - 1] if nch else 0
        head = sum(p.bwd_time for p in profile.parts[first:]) + (t_down[-1] if nch else 0.0)
        cpu_lb = np.maximum(np.where(np_idx < nch, head + adam, 0.0), down_suffix[np_idx])
    else:
        cpu_lb = bwd_lb + adam
    lb = fwd_lb + np.maximum(bwd_lb + gpu, cpu_lb)
    tail = np.zeros(len(lb))
    if config.grad_accumulation_steps > 1:
        # A micro-step without the optimizer ends with backward's compute (cost.runtime does
        # not wait for the last gradient copies there), so the D2H queue is no bound on it.
        tail = (config.grad_accumulation_steps - 1) * (fwd_lb + bwd_lb)
        lb = lb + tail
    # Bytes per micro-step: offloaded chunks up in forward and their gradients down; chunks
    # not among the last n_buffer up again in backward; swapped and NVMe activations out
    # and back in (cost.runtime counts the same).
    ub = _chunk_bytes_prefix(layout, profile, config)
    moved = config.grad_accumulation_steps * (
        2.0 * (ub[nch] - ub[np_idx]) + _reupload_bytes(layout, profile, config, np_idx, nb) +
        2.0 * (acts.swap_host[a_idx] + acts.ssd[a_idx]))
    return _Grid(layout, a_idx, np_idx, nb, nbmin, peak, host, lb, fwd_lb, bwd_lb + gpu, tail,
                 moved)


class _VerdictBound:
    """A lower bound on the iteration of a plan whose CPU Adam waits for the step's verdict
    (clipping / fp16) and runs on into the next forward, for each count s of speculating
    chunks (the top s offloaded ones: cost.runtime backs each up, then updates it, during
    backward). Counted from one forward's end to the next, with c the chunk whose update the
    CPU does last (n - s - 1, the last left for after backward in chunk order; with every
    offloaded chunk speculating, the lowest), and the next forward's upload of c starting
    at least the uploads of chunks c..n-1 before that forward ends, the iteration is at least
      - ``chain(s)``: the first gradient (backward of the parts from the last chunk's first
        user, its copy to the host), then every piece of CPU work of the step - every update,
        the host checks, the s backups; then those uploads;
      - ``after(s)`` (s below the offloaded count): backward, until it is over and the
        lowest offloaded chunk's gradients - the last to land - are on the host; then the
        updates left for after it; then those uploads.
    ``chain`` grows with s; ``after`` falls while an update outlasts an upload (always, but for
    the tail of a very fast CPU Adam). ``least(s_max)`` is the least over s in [0, s_max],
    where the two cross (one search over prefix sums of the layout's chunks from the top, the
    same for every plan of the layout; the falling side taken as its running minimum, which
    only lowers it). For a model bound by its CPU Adam this lies within a few hundredths of a
    per cent of the simulated time, where the CPU's busy time alone leaves out the backups,
    the updates after backward and the copies around them."""

    def __init__(self, profile: ModelProfile, layout, hw: HardwareProfile, config: PlannerConfig,
                 n_persist, backward, checks):
        world = config.data_parallel_size
        nch = layout.n_chunks
        t_up, t_down, t_adam = chunk_transfer_times(layout, profile, hw, world)
        top = lambda t: np.concatenate([[0.0], np.cumsum(t[::-1])])    # noqa: E731  (last s chunks)
        self.adam_top = top(t_adam)
        self.backup_top = top(backup_times(layout, hw, t_adam, world))
        self.up_next = np.concatenate([top(t_up)[1:], [0.0]])           # uploads of the last s + 1
        self.n_off = nch - np.asarray(n_persist)
        self.adam = self.adam_top[self.n_off]
        self.backward, self.checks = backward, checks
        lead = _first_gradient(profile, layout) + (t_down[-1] if nch else 0.0)
        self.lead = np.where(self.n_off > 0, lead, 0.0)

    def _uploads(self, s):
        """Uploads from the chunk the CPU updates last to the end (none without offloading)."""
        return np.where(self.n_off > 0, self.up_next[np.minimum(s, np.maximum(self.n_off - 1, 0))], 0.0)

    def _chain(self, s):
        return self.lead + self.adam + self.checks + self.backup_top[s] + self._uploads(s)

    def at(self, s):
        after = np.where(s < self.n_off, self.backward + self.adam - self.adam_top[s] + self.up_next[s],
                         self.backward)
        return np.maximum(self._chain(s), after)

    def least(self, s_max):
        # s < n_off: after(s) >= backward + adam - fall[s], fall nondecreasing; chain(s) >= it
        # from s_cross on.
        fall = np.maximum.accumulate(self.adam_top - self.up_next)
        s_lim = np.minimum(s_max, self.n_off - 1)
        s_cross = np.searchsorted(self.backup_top + self.up_next + fall,
                                  self.backward - self.checks - self.lead, side="left")
        best = np.full(np.shape(s_lim), np.inf)
        for s in (s_cross - 1, s_cross):
            s = np.clip(s, 0, np.maximum(s_lim, 0))
            v = np.maximum(self._chain(s), self.backward + self.adam - fall[s])
            best = np.where(s_lim >= 0, np.minimum(best, v), best)
        return np.where(s_max >= self.n_off, np.minimum(best, self.at(self.n_off)), best)


_PRUNE_MARGIN = 1e-6
"""How far a speculating count's lower bound must lie above the time of all that fit before
it is not simulated (``_boundary_times``): far beyond the rounding between a bound and a
simulation, so a count that could tie - and win the tie, being smaller - is always simulated."""


def _backward_compute(profile: ModelProfile, codes: np.ndarray) -> np.ndarray:
    """Backward's compute per plan: every part's backward plus the recomputed forwards."""
    fwd = np.array([b.fwd_time for b in profile.blocks])
    sel = np.array([b.sel_recompute_time for b in profile.blocks])
    return sum(p.bwd_time for p in profile.parts) + (codes == CKPT).astype(np.float64) @ fwd + \
        (codes == SEL).astype(np.float64) @ sel


def _backward_bound(profile, layout, hw, world, n_persist, n_buffer, bwd) -> np.ndarray:
    """A lower bound on the time from forward's end until backward is over and every
    offloaded gradient is on the host (_VerdictBound's ``backward``): ``bwd`` (a bound on
    backward alone: its compute, or more), the re-uploads (issued in backward), the gradient
    copies (one queue, from the first gradient)."""
    t_up, t_down, _ = chunk_transfer_times(layout, profile, hw, world)
    up = np.concatenate([np.cumsum(t_up[::-1])[::-1], [0.0]])
    down = np.concatenate([np.cumsum(t_down[::-1])[::-1], [0.0]])
    reup = up[n_persist] - up[np.maximum(layout.n_chunks - n_buffer, n_persist)]
    return np.maximum(np.maximum(bwd, reup), _first_gradient(profile, layout) + down[n_persist])


def _first_gradient(profile, layout) -> float:
    """Backward's compute before the first gradient copy can start: the parts from the last
    chunk's first user on (recompute left out: a bound for every plan)."""
    first = layout.chunk_first_part[layout.n_chunks - 1] if layout.n_chunks else len(profile.parts)
    return sum(p.bwd_time for p in profile.parts[first:])


def _host_checks(layout, hw: HardwareProfile, config: PlannerConfig, n_persist):
    """CPU time of the verdict checks over the offloaded chunks, where they are taken on the
    host (accumulated gradients under clipping / fp16); 0 elsewhere."""
    if config.cpu_optim_overlap or not _checks_on_host(config):
        return 0.0
    suffix = np.concatenate([np.cumsum(check_times(layout, hw, config.data_parallel_size)[::-1])[::-1], [0.0]])
    return suffix[np.asarray(n_persist)]


def _speculation_max(layout, hw: HardwareProfile, config: PlannerConfig, n_persist, host_bytes):
    """The most offloaded chunks a plan may speculate with (``_boundary_times`` picks among
    none, these, and a count in between): the pin, else those whose backups fit the host
    memory left; none without speculation."""
    n_off = layout.n_chunks - np.asarray(n_persist)
    if not _speculates(config):
        return np.zeros_like(n_off)
    if config.speculate_chunks is not None:
        return np.minimum(config.speculate_chunks, n_off)
    top = _backup_from_top(layout, config.data_parallel_size)
    room = hw.host_memory - np.asarray(host_bytes, dtype=np.int64)
    return np.minimum(n_off, np.searchsorted(top, room, side="right") - 1).clip(min=0)


def _chunk_bytes_prefix(layout, profile, config) -> np.ndarray:
    """Bytes one rank copies for chunks [0, c), at index c."""
    return np.concatenate([[0.0], np.cumsum(np.asarray(layout.used, dtype=np.float64) *
                                            profile.param_bytes / config.data_parallel_size)])


def _reupload_bytes(layout, profile, config, n_persist, n_buffer) -> np.ndarray:
    """Bytes of the offloaded chunks uploaded again in backward (not among the last n_buffer)."""
    ub = _chunk_bytes_prefix(layout, profile, config)
    return ub[np.maximum(layout.n_chunks - np.asarray(n_buffer), n_persist)] - ub[n_persist]


def _refine_cpu_bound(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig,
                      acts: _ActivationConfigs, grid: _Grid, idx: np.ndarray) -> np.ndarray:
    """A tighter lower bound for points ``idx`` of ``grid`` when CPU Adam overlaps backward,
    computed only for the points about to be simulated (it needs their block layouts).

    CPU Adam steps the offloaded chunks one at a time in the order their gradients complete
    (descending index), so for every offloaded chunk c the CPU is busy until at least the
    backward (with its recompute) of the parts from c's first user on, plus c's gradient
    offload, plus Adam over c and every offloaded chunk below it. Near the optimum of a
    CPU-bound model thousands of plans differ by less than the slack of the coarse bound
    (which counts only the last chunk and no recompute); this one tells them apart."""
    if not config.cpu_optim_overlap or not len(idx) or _weak_cpu_bound(config, hw):
        return grid.lower_bound[idx]
    layout = grid.layout
    nch = layout.n_chunks
    _, t_down, t_adam = chunk_transfer_times(layout, profile, hw, config.data_parallel_size)
    codes = acts.codes(grid.a[idx])
    fwd = np.array([b.fwd_time for b in profile.blocks])
    sel = np.array([b.sel_recompute_time for b in profile.blocks])
    per_part = np.tile(np.array([p.bwd_time for p in profile.parts]), (len(idx), 1))
    per_part[:, list(profile.block_part_indices)] += np.where(codes == CKPT, fwd, 0.0) + \
        np.where(codes == SEL, sel, 0.0)
    done = np.cumsum(per_part[:, ::-1], axis=1)[:, ::-1]         # backward until part p is done
    adam_upto = np.concatenate([[0.0], np.cumsum(t_adam)])       # sum over chunks below c
    chain = done[:, list(layout.chunk_first_part)] + t_down + adam_upto[1:]
    chain = np.maximum.accumulate(chain[:, ::-1], axis=1)[:, ::-1]   # max over chunks >= c
    chain = np.concatenate([chain, np.full((len(idx), 1), -np.inf)], axis=1)
    npi = grid.n_persist[idx]
    cpu = np.where(npi < nch, chain[np.arange(len(idx)), npi] - adam_upto[npi], 0.0)
    refined = grid.fwd_lb[idx] + np.maximum(grid.dev_lb[idx], cpu) + grid.tail_lb[idx]
    return np.maximum(grid.lower_bound[idx], refined)


def _in_bound_order(lbs: np.ndarray):
    """Batches of point indices in increasing lower bound: the first few batches from a
    partial sort (the search usually stops there), the rest from a full one."""
    head = min(len(lbs), 16 * _BATCH)
    first = np.argpartition(lbs, head - 1)[:head] if head < len(lbs) else np.arange(len(lbs))
    first = first[np.argsort(lbs[first], kind="stable")]
    for lo in range(0, len(first), _BATCH):
        yield first[lo:lo + _BATCH]
    if head < len(lbs):
        rest = np.setdiff1d(np.arange(len(lbs)), first, assume_unique=True)
        rest = rest[np.argsort(lbs[rest], kind="stable")]
        for lo in range(0, len(rest), _BATCH):
            yield rest[lo:lo + _BATCH]


def _state_bytes(profile: ModelProfile, config: PlannerConfig):
    return state_bytes(profile.param_bytes, config.grad_accumulation_steps > 1)


def _norm_scratch(profile: ModelProfile, config: PlannerConfig, layout) -> np.ndarray:
    """Per n_persist: the clipping norm's fp32 scratch (none with the framework's own states)."""
    if config.model_states_fixed is not None:
        return np.zeros(layout.n_chunks + 1, dtype=np.int64)
    return norm_scratch_bytes(profile, layout, config.gradient_clipping, config.grad_accumulation_steps > 1)


def _carries_over(config: PlannerConfig, hw: HardwareProfile) -> bool:
    """Whether CPU Adam left at the end of a step runs into the next forward (the runtime does,
    except with fixed model states; on a CPU "device" it runs inline anyway)."""
    return config.model_states_fixed is None and (hw.copy_engines > 0 or hw.cpu_adam_thread)


def _weak_cpu_bound(config: PlannerConfig, hw: HardwareProfile) -> bool:
    """Whether CPU Adam may end after the step's device work by less than its chain through
    backward: updates carried into the next forward - those left for after backward, or, on a
    CPU "device" whose CPU Adam has a thread, any (the next forward's first upload waits for
    compute there, not only for its update)."""
    return _carries_over(config, hw) and (not config.cpu_optim_overlap or hw.copy_engines <= 0)


def _checks_on_host(config: PlannerConfig) -> bool:
    """Where the runtime takes the step's verdict inputs: on the host for accumulated
    gradients, else on the device before the gradients leave (runtime/optimizer.py)."""
    return config.grad_accumulation_steps > 1


def _speculates(config: PlannerConfig) -> bool:
    return config.cpu_optim_speculative and config.model_states_fixed is None


def _boundary_times(profile, layout, hw, config, n_persist, n_buffer, codes, host_bytes):
    """(iteration time, offloaded chunks speculating) of each plan's boundary micro-step: what
    the search ranks and ``evaluate`` predicts, one function for both.

    Without speculation the count is 0. With it (clipping / fp16 loss scaling): the pin, else
    the fastest of three counts whose backups fit the host memory left (ties: fewer) - none;
    all of them; and the chunks whose backup is done before backward ends when all speculate
    (a chunk whose backup is not only delays the updates left for after backward by it: the
    count where the curve turns, read off that one simulation, as the CPU reaches the chunks
    in the same order whichever of the later ones speculate)."""
    world = config.data_parallel_size
    k = len(np.atleast_1d(n_persist))
    npers = np.broadcast_to(np.asarray(n_persist, dtype=np.int64), (k,))
    nbuf = np.broadcast_to(np.asarray(n_buffer, dtype=np.int64), (k,))
    codes = np.broadcast_to(codes, (k, codes.shape[-1]))

    def run(n_spec, rows=slice(None)):
        return simulate(profile, layout, hw, npers[rows], nbuf[rows], codes[rows],
                        cpu_overlap=config.cpu_optim_overlap, world=world,
                        carry_over=_carries_over(config, hw), checks_on_host=_checks_on_host(config),
                        speculate_from=layout.n_chunks - n_spec if n_spec is not None else None)
    if not _speculates(config):
        return run(None).iter_time, np.zeros(k, dtype=np.int64)
    if config.speculate_chunks is not None:
        n = np.minimum(config.speculate_chunks, layout.n_chunks - npers)
        return run(n).iter_time, n
    n_fit = _speculation_max(layout, hw, config, npers, host_bytes)
    # Candidates in increasing count - none, the turn, all that fit - a later one winning only
    # if strictly faster. All that fit is simulated first (the turn is read off it), then the
    # turn; a smaller count whose lower bound (_VerdictBound) lies clearly above the best of
    # those cannot win, and is not simulated - for a model bound by its CPU Adam, none (every
    # update after backward) rarely can.
    some = np.flatnonzero(n_fit > 0)
    bounded = not config.cpu_optim_overlap and _carries_over(config, hw) and len(some)
    if bounded:
        vb = _VerdictBound(profile, layout, hw, config, npers[some],
                           _backward_bound(profile, layout, hw, world, npers[some], nbuf[some],
                                           _backward_compute(profile, codes[some])),
                           _host_checks(layout, hw, config, npers[some]))
    t_turn = np.full(k, np.inf)
    if len(some):
        every = run(n_fit[some], some)
        turn = np.minimum(every.spec_useful, n_fit[some])
        mid = np.flatnonzero((turn > 0) & (turn < n_fit[some]))
        if bounded:
            mid = mid[vb.at(turn)[mid] <= every.iter_time[mid] * (1 + _PRUNE_MARGIN)]
        if len(mid):
            t_turn[some[mid]] = run(turn[mid], some[mid]).iter_time
    rows = np.arange(k)
    if bounded:
        beaten = np.zeros(k, dtype=bool)
        beaten[some] = vb.at(0) > np.minimum(every.iter_time, t_turn[some]) * (1 + _PRUNE_MARGIN)
        rows = np.flatnonzero(~beaten)
    best, count = np.full(k, np.inf), np.zeros(k, dtype=np.int64)
    if len(rows):
        best[rows] = run(np.zeros(len(rows), dtype=np.int64), rows).iter_time
    if len(some):
        for r, n, t in ((some[mid], turn[mid], t_turn[some[mid]]), (some, n_fit[some], every.iter_time)):
            faster = t < best[r] * (1 - 1e-12)
            best[r] = np.where(faster, t, best[r])
            count[r] = np.where(faster, n, count[r])
    return best, count


def _backup_from_top(layout, world: int) -> np.ndarray:
    """Host bytes of the backups of the last k chunks, at index k (12 bytes - master, exp_avg,
    exp_avg_sq - per parameter of this rank's shard)."""
    shard = -(-np.asarray(layout.used, dtype=np.int64) // world) * 12
    return np.concatenate([[0], np.cumsum(shard[::-1])])


def _simulate_points(profile, hw, config, acts, grid: _Grid, idx: np.ndarray,
                     n_buffer=None) -> np.ndarray:
    """Time of one optimizer step: the boundary micro-step plus the others, if any."""
    nb = grid.n_buffer[idx] if n_buffer is None else n_buffer
    args = (profile, grid.layout, hw, grid.n_persist[idx], nb, acts.codes(grid.a[idx]))
    world = config.data_parallel_size
    t = _boundary_times(*args[:2], hw, config, *args[3:], grid.host[idx])[0]
    if config.grad_accumulation_steps > 1:
        t = t + (config.grad_accumulation_steps - 1) * simulate(
            *args, optimizer_step=False, world=world).iter_time
    return t


def search(profile: ModelProfile, hw: HardwareProfile,
           config: PlannerConfig | None = None) -> Plan:
    """The fastest plan for ``profile`` on ``hw`` within ``config``'s budgets and pins.
    Raises InfeasibleError (with what would fit) when nothing does."""
    config = config or PlannerConfig()
    if (config.pins.sequence_parallel or 1) > 1:
        raise ValueError("search() plans one rank's profile as it is; a sequence-parallel degree "
                         "is chosen by protrain.sp.planner.search_sequence_parallel")
    t0 = time.perf_counter()
    hw = hw.with_limits(device_memory=config.device_memory, host_memory=config.host_memory)
    budget = hw.device_memory / (1.0 + config.memory_margin)
    acts = _activation_configs(profile, config, hw)
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
    stats: dict = {}
    grids = [_grid(profile, hw, config, acts, cap, budget, stats) for cap in caps]
    total = sum(len(g.lower_bound) for g in grids)
    if total == 0:
        raise _infeasible(profile, hw, config, budget, stats, acts, caps)

    lbs = np.concatenate([g.lower_bound for g in grids])
    moved = np.concatenate([g.moved for g in grids])
    owner = np.concatenate([np.full(len(g.lower_bound), i) for i, g in enumerate(grids)])
    local = np.concatenate([np.arange(len(g.lower_bound)) for g in grids])
    times = np.full(total, np.inf)
    simulated = np.zeros(total, dtype=bool)
    best = np.inf
    evaluated = 0
    early = None
    # 1. The fastest time: points in order of their lower bound until none can beat it. A
    # bound is summed in another order than the simulation: one a rounding error above the
    # best time may still be a plan tied with it (ties go to the lower peak, then the smaller
    # knobs), so it is simulated too.
    tie = 1 + BOUND_ROUNDING
    for take in _in_bound_order(lbs):
        lowest = lbs[take[0]]
        if lowest > best * tie:
            break
        if evaluated >= EXACT_SIMULATIONS and lowest >= best * (1 - TIE_TOLERANCE):
            early = (total - int(simulated.sum()), (best - lowest) / best)
            break
        for gi in np.unique(owner[take]):
            sel = take[owner[take] == gi]
            lbs[sel] = _refine_cpu_bound(profile, hw, config, acts, grids[gi], local[sel])
            sel = sel[lbs[sel] <= best * tie]     # best only falls: the others can never win
            if len(sel):
                times[sel] = _simulate_points(profile, hw, config, acts, grids[gi], local[sel])
                simulated[sel] = True
                evaluated += len(sel)
                best = min(best, times[sel].min())

    # 2. The hedge's candidates: points whose bound lies in the band, by bytes moved (known
    # without simulating), until the fewest bytes of a plan found in the band is below
    # every remaining point's.
    band = best * (1.0 + config.time_tolerance)
    while True:
        least = moved[times <= band].min()
        cand = np.flatnonzero(~simulated & (lbs <= band) & (moved <= least))
        if not len(cand):
            break
        take = cand[np.argsort(moved[cand], kind="stable")[:_BATCH]]
        for gi in np.unique(owner[take]):
            sel = take[owner[take] == gi]
            times[sel] = _simulate_points(profile, hw, config, acts, grids[gi], local[sel])
        simulated[take] = True
        evaluated += len(take)

    # The hedge: within the band, the fewest bytes moved, then the fastest. Points tied on
    # both keep the fewest buffers that leave both unchanged (more buffers never slow a plan
    # down nor move more). Tied points are refined in order of the lowest peak they could
    # reach (their fewest buffers), a batch at a time, bisecting each point's buffer count,
    # until none can beat the lowest peak found: a bound-limited dominant resource ties
    # thousands of plans exactly.
    in_band = np.flatnonzero(times <= band)
    first = in_band[np.lexsort((times[in_band], moved[in_band]))[0]]
    target = (moved[first], times[first])
    tied = [int(i) for i in in_band if (moved[i], times[i]) == target]
    refined: dict[int, tuple[int, int]] = {}
    if config.pins.n_buffer is None:
        gas = config.grad_accumulation_steps
        sbuf = _state_bytes(profile, config).buffer
        unit = [sbuf * buffer_numel(g.layout, config.data_parallel_size) for g in grids]
        at_best = np.array(tied, dtype=np.int64)
        peak_now = np.array([grids[owner[i]].peak[local[i]] for i in at_best], dtype=np.int64)
        spare = np.array([grids[owner[i]].n_buffer[local[i]] - grids[owner[i]].n_buffer_min[local[i]]
                          for i in at_best], dtype=np.int64)
        peak_low = peak_now - spare * np.array([unit[owner[i]] for i in at_best], dtype=np.int64)
        best_peak = int(peak_now.min()) if len(at_best) else 0
        order = [k for k in np.argsort(peak_low, kind="stable") if spare[k] > 0]
        for lo in range(0, len(order), 512):
            batch = [k for k in order[lo:lo + 512] if peak_low[k] <= best_peak]
            if not batch:
                break
            for gi in sorted({int(owner[at_best[k]]) for k in batch}):
                g = grids[gi]
                pts = [int(at_best[k]) for k in batch if owner[at_best[k]] == gi]
                # Search each point's fewest buffers that keep the target (time and bytes
                # never rise with buffers): k evenly spaced counts below the known one per
                # point in one batched simulation a round, k as large as a batch allows - a
                # simulation's fixed cost (its loop over parts and chunks) far exceeds a row's.
                low = {i: int(g.n_buffer_min[local[i]]) for i in pts}
                high = {i: int(g.n_buffer[local[i]]) for i in pts}
                while True:
                    active = [i for i in pts if low[i] < high[i]]
                    if not active:
                        break
                    tries = max(2, min(_SWEEP, _BATCH // len(active)))
                    rows = [(i, nb) for i in active for nb in
                            sorted({low[i] + (high[i] - low[i]) * m // tries for m in range(tries)})]
                    idx = np.array([local[i] for i, _ in rows])
                    nbs = np.array([nb for _, nb in rows])
                    t = _simulate_points(profile, hw, config, acts, g, idx, n_buffer=nbs)
                    mv = g.moved[idx] + gas * (
                        _reupload_bytes(g.layout, profile, config, g.n_persist[idx], nbs) -
                        _reupload_bytes(g.layout, profile, config, g.n_persist[idx], g.n_buffer[idx]))
                    evaluated += len(rows)
                    kept = [(i, nb, (mi, ti) == target) for (i, nb), ti, mi in zip(rows, t, mv)]
                    for i, nb, ok in kept:
                        if ok:
                            high[i] = min(high[i], nb)
                    for i, nb, ok in kept:  # the next round searches above the highest failure
                        if not ok and nb < high[i]:
                            low[i] = max(low[i], nb + 1)
                for i in pts:
                    j = local[i]
                    if high[i] < g.n_buffer[j]:
                        refined[i] = (high[i], int(g.peak[j] - (g.n_buffer[j] - high[i]) * unit[gi]))
                        best_peak = min(best_peak, refined[i][1])

    def knobs_of(i: int) -> Knobs:
        g, j = grids[owner[i]], local[i]
        nb = refined.get(i, (int(g.n_buffer[j]),))[0]
        return Knobs(chunk_size=g.layout.chunk_bytes, n_persist=int(g.n_persist[j]), n_buffer=nb,
                     n_swap=int(acts.n_swap[g.a[j]]), n_checkpoint=int(acts.n_ckpt[g.a[j]]),
                     n_ssd=int(acts.n_ssd[g.a[j]]), n_selective=int(acts.n_sel[g.a[j]]))

    def peak_of(i: int) -> int:
        g, j = grids[owner[i]], local[i]
        return refined.get(i, (0, int(g.peak[j])))[1]

    chosen_i = min(tied, key=lambda i: plan_key(times[i], peak_of(i), knobs_of(i).as_tuple()))
    chosen = knobs_of(chosen_i)
    # Runner-ups: the fastest other plans (one per activation configuration and chunk size).
    done = np.flatnonzero(np.isfinite(times))
    peaks = np.array([peak_of(i) for i in done])
    order = [i for i in done[np.lexsort((peaks, times[done]))] if i != chosen_i]
    shape = lambda k: (k.chunk_size, k.n_checkpoint, k.n_swap, k.n_ssd, k.n_selective)  # noqa: E731
    alternatives, seen = [], {shape(chosen)}
    for i in order:
        if len(alternatives) >= config.runner_ups:
            break
        k = knobs_of(i)
        if shape(k) in seen:
            continue
        seen.add(shape(k))
        g, j = grids[owner[i]], local[i]
        alternatives.append(Alternative(knobs=k, iter_time=float(times[i]),
                                        peak_device_bytes=peak_of(i), host_bytes=int(g.host[j])))
    notes = ()
    fastest = min(done, key=lambda i: (times[i], moved[i]))
    if moved[chosen_i] < moved[fastest]:
        notes = (f"hedged: plans predicted within the runtime model's {config.time_tolerance:.0%} "
                 f"error band of the fastest ({fmt_seconds(float(best))}/step) count as equally "
                 f"fast; this one ({fmt_seconds(float(times[chosen_i]))}) moves the fewest bytes, "
                 f"{fmt_bytes(int(moved[chosen_i]))} per step against {fmt_bytes(int(moved[fastest]))} "
                 f"for the fastest",)
    if early is not None:
        notes += (f"search stopped after {evaluated} simulations: the {early[0]} candidates not "
                  f"simulated could be at most {early[1]:.4%} faster",)
    return replace(evaluate(profile, hw, chosen, config, alternatives=tuple(alternatives),
                            search_seconds=time.perf_counter() - t0, evaluated=evaluated,
                            total=total), notes=notes)


def check_budgets(total_params: int, largest_param: int, param_bytes: int,
                  config: PlannerConfig, *, grad_accumulation: bool = False) -> None:
    """Refuse budgets no plan can meet, from the parameter counts alone (before profiling):
    one chunk buffer must hold the largest parameter, and device plus host memory must hold
    the model states. The search makes the exact check once the model is profiled."""
    sb = state_bytes(param_bytes, grad_accumulation)
    margin = 1 + config.memory_margin
    if config.device_memory is not None:
        need = largest_param * param_bytes * margin
        if config.device_memory < need:
            raise InfeasibleError(
                f"device_memory={fmt_bytes(config.device_memory)} cannot hold even the largest "
                f"parameter ({fmt_bytes(largest_param * param_bytes)}, with the {config.memory_margin:.0%} "
                f"margin {fmt_bytes(need)}); raise device_memory or remove the limit",
                device_needed=int(need))
    if config.device_memory is not None and config.host_memory is not None:
        states = total_params * min(sb.host, sb.persistent)
        if config.device_memory / margin + config.host_memory < states:
            raise InfeasibleError(
                f"device_memory={fmt_bytes(config.device_memory)} plus host_memory="
                f"{fmt_bytes(config.host_memory)} cannot hold the model states: "
                f"{total_params / 1e6:.1f} M parameters need at least {fmt_bytes(states)} "
                f"({min(sb.host, sb.persistent)} bytes each); raise the limits",
                host_needed=int(states - config.device_memory / margin))


def evaluate(profile: ModelProfile, hw: HardwareProfile, knobs: Knobs,
             config: PlannerConfig | None = None, *, alternatives=(), search_seconds=0.0,
             evaluated=1, total=1, check_fit: bool = False,
             block_modes: tuple[BlockMode, ...] | None = None) -> Plan:
    """The Plan (with predictions) for given knobs, e.g. a plan loaded from a file replayed on
    a new profile. With ``check_fit`` raise InfeasibleError if it does not fit. ``block_modes``
    replaces ProTrain's block layout for the same counts (a framework that can only checkpoint
    the first blocks natively, as Megatron's ``--recompute-method block``)."""
    config = config or PlannerConfig()
    hw = hw.with_limits(device_memory=config.device_memory, host_memory=config.host_memory)
    layout = build_layout(profile, knobs.chunk_size // profile.param_bytes)
    modes = layout_block_modes(profile.n_blocks, knobs.n_swap, knobs.n_checkpoint, knobs.n_ssd,
                               knobs.n_selective)
    if block_modes is not None:
        if len(block_modes) != profile.n_blocks or not same_counts(block_modes, modes):
            raise ValueError(f"block_modes {modes_string(block_modes)} do not match the knobs {knobs} "
                             f"for {profile.n_blocks} blocks")
        modes = tuple(block_modes)
    if knobs.n_selective and not profile.has_selective:
        raise InfeasibleError(f"n_selective={knobs.n_selective}: the profile has no selective-mode "
                              f"measurements (no attention operator seen in the blocks); use 0")
    if not layout.min_persist <= knobs.n_persist <= layout.n_chunks:
        raise InfeasibleError(f"n_persist={knobs.n_persist} must be between {layout.min_persist} "
                              f"and the {layout.n_chunks} chunks of this layout")
    nb_min = layout.min_buffers(knobs.n_persist)
    offloaded = layout.n_chunks - knobs.n_persist
    if knobs.n_buffer > offloaded:
        raise InfeasibleError(f"n_buffer={knobs.n_buffer} is more than the {offloaded} offloaded "
                              f"chunk(s) (n_persist={knobs.n_persist} of {layout.n_chunks}); use at "
                              f"most {offloaded}")
    if knobs.n_buffer < nb_min:
        raise InfeasibleError(f"n_buffer={knobs.n_buffer} is below {nb_min}, the chunks one block "
                              f"spans with n_persist={knobs.n_persist}; use at least {nb_min}")
    world = config.data_parallel_size
    mem = predict_memory(profile, layout, knobs.n_persist, knobs.n_buffer, modes,
                         _state_bytes(profile, config), world,
                         norm_scratch=int(_norm_scratch(profile, config, layout)[knobs.n_persist]))
    if config.model_states_fixed is not None:
        mem = replace(mem, model_state_bytes=config.model_states_fixed, host_bytes=mem.swap_host_bytes,
                      peak_device_bytes=config.model_states_fixed + mem.activation_peak_bytes)
    codes = np.array([[m.code for m in modes]], dtype=np.int8)
    n_spec = int(_boundary_times(profile, layout, hw, config, knobs.n_persist, knobs.n_buffer, codes,
                                 mem.host_bytes)[1][0])
    mem = replace(mem, host_bytes=mem.host_bytes + int(_backup_from_top(layout, world)[n_spec]))
    spec_from = layout.n_chunks - n_spec if _speculates(config) else None
    timed = lambda **kw: simulate(  # noqa: E731
        profile, layout, hw, knobs.n_persist, knobs.n_buffer, codes, cpu_overlap=config.cpu_optim_overlap,
        world=world, carry_over=_carries_over(config, hw), checks_on_host=_checks_on_host(config), **kw)
    t = timed(speculate_from=spec_from)
    # The runtime's rule: a step after one that clipped (or overflowed) does not speculate; a
    # speculated step that clips restores and redoes its chunks.
    unspeculated = float((timed(speculate_from=layout.n_chunks) if n_spec else t).iter_time[0])
    rolled_back = float((timed(speculate_from=spec_from, speculation_wrong=True) if n_spec
                         else t).iter_time[0])
    timeline = predicted_timeline(
        profile, layout, hw, knobs.n_persist, knobs.n_buffer, codes,
        model_state_bytes=mem.model_state_bytes, memory_limit=hw.device_memory,
        title=f"{profile.name}: {layout.n_chunks - knobs.n_persist} of {layout.n_chunks} chunks "
              f"offloaded, blocks ckpt {knobs.n_checkpoint} swap {knobs.n_swap} ssd {knobs.n_ssd} "
              f"sel {knobs.n_selective}",
        cpu_overlap=config.cpu_optim_overlap, world=world, speculate_from=spec_from,
        carry_over=_carries_over(config, hw), checks_on_host=_checks_on_host(config))
    gas = config.grad_accumulation_steps
    micro = float(simulate(profile, layout, hw, knobs.n_persist, knobs.n_buffer, codes,
                           optimizer_step=False, world=world).iter_time[0]) if gas > 1 else float(t.iter_time[0])
    if check_fit:
        need = mem.peak_device_bytes * (1 + config.memory_margin)
        if mem.ssd_bytes and mem.ssd_bytes * (1 + config.memory_margin) > hw.nvme_free_bytes:
            raise InfeasibleError(f"plan {knobs} writes {fmt_bytes(mem.ssd_bytes)} of activations "
                                  f"to NVMe but the SSD path has {fmt_bytes(hw.nvme_free_bytes)} free")
        if need > hw.device_memory or mem.host_bytes > hw.host_memory:
            raise InfeasibleError(
                f"plan {knobs} needs {fmt_bytes(need)} device (with margin) and "
                f"{fmt_bytes(mem.host_bytes)} host, but {fmt_bytes(hw.device_memory)} device and "
                f"{fmt_bytes(hw.host_memory)} host are available",
                device_needed=int(need), host_needed=mem.host_bytes)
    f = lambda a: float(a[0])  # noqa: E731
    pred = Prediction(
        iter_time=f(t.iter_time), step_time=f(t.iter_time) + (gas - 1) * micro,
        micro_step_time=micro, grad_accumulation_steps=gas,
        fwd_time=f(t.fwd_time), bwd_time=f(t.bwd_time),
        gpu_optim_time=f(t.gpu_optim_time), cpu_optim_time=f(t.cpu_optim_time),
        cpu_optim_exposed=f(t.cpu_optim_exposed), peak_device_bytes=mem.peak_device_bytes,
        model_state_bytes=mem.model_state_bytes, activation_peak_bytes=mem.activation_peak_bytes,
        peak_at=mem.peak_at, host_bytes=mem.host_bytes, swap_host_bytes=mem.swap_host_bytes,
        h2d_bytes=int(t.h2d_bytes[0]), d2h_bytes=int(t.d2h_bytes[0]), ssd_bytes=mem.ssd_bytes,
        iter_time_unspeculated=unspeculated, iter_time_rolled_back=rolled_back,
        norm_scratch_bytes=mem.norm_scratch_bytes)
    return Plan(
        knobs=knobs, block_modes=modes,
        chunks=ChunkSummary(n_chunks=layout.n_chunks, chunk_numel=layout.chunk_numel,
                            total_numel=layout.total_numel, min_persist=layout.min_persist),
        prediction=pred, model=profile.describe(), machine=hw.describe(),
        device_memory=hw.device_memory, host_memory=hw.host_memory,
        memory_margin=config.memory_margin, param_bytes=profile.param_bytes,
        profile_source=profile.source, pinned=tuple(sorted(config.pins.pinned())),
        alternatives=tuple(alternatives), search_seconds=search_seconds,
        candidates_evaluated=int(evaluated), candidates_total=int(total),
        params=profile.params if profile.source == "measured" else (),
        block_saved_bytes=tuple(offload_bytes(b) for b in profile.blocks),
        micro_batch=profile.micro_batch, seq_len=profile.seq_len, n_speculate=n_spec,
        timeline=timeline, ranks_per_node=hw.ranks_per_node)


def _leanest(profile, config, acts, caps, host_memory) -> tuple[float, float]:
    """(peak, model-state part of it) of the plan with the smallest device peak whose host
    needs fit ``host_memory`` (any n_persist, the fewest buffers)."""
    best = (np.inf, np.inf)
    for cap in caps:
        layout = build_layout(profile, cap)
        sb = _state_bytes(profile, config)
        prefix = np.concatenate([[0], np.cumsum(layout.used, dtype=np.int64)])
        nps = np.arange(layout.min_persist, layout.n_chunks + 1)
        world = config.data_parallel_size
        shard = np.concatenate([[0], np.cumsum([-(-u // world) for u in layout.used], dtype=np.int64)])
        states = prefix[nps] * sb.persistent + \
            layout.min_buffers_table()[nps] * buffer_numel(layout, world) * sb.buffer
        host = (shard[-1] - shard[nps]) * sb.host
        if config.model_states_fixed is not None:
            states = np.full(len(nps), config.model_states_fixed, dtype=np.int64)
            host = np.zeros(len(nps), dtype=np.int64)
        peak = (states + _norm_scratch(profile, config, layout)[nps])[None, :] + acts.act_peak[:, None]
        ok = host[None, :] + acts.swap_host[:, None] <= host_memory
        if ok.any():
            a, j = np.unravel_index(np.where(ok, peak, np.inf).argmin(), peak.shape)
            best = min(best, (float(peak[a, j]), float(states[j])))
    return best


def _infeasible(profile, hw, config, budget, stats, acts, caps) -> InfeasibleError:
    margin = config.memory_margin
    pins = config.pins.pinned()
    if pins:
        # Would it fit without the pins? Then the pins are the problem; say so.
        from dataclasses import replace
        from .config import KnobPins
        try:
            free = search(profile, hw, replace(config, pins=KnobPins()))
        except InfeasibleError:
            free = None
        # The sequence-parallel degree is not this search's (it plans one rank's profile). Pins
        # on every other knob but n_selective (a configuration written before that knob) name
        # one plan too: the one without selective blocks (had it fit, the search found it).
        fixed = {k: v for k, v in pins.items() if k != "sequence_parallel"}
        fixed.setdefault("n_selective", 0)
        if len(fixed) == len(KNOB_NAMES) - 1:
            # Every knob fixed: say which constraint that one plan breaks.
            from .plan import Knobs
            if pins["n_persist"] == ALL:
                pins = dict(pins, n_persist=build_layout(
                    profile, pins["chunk_size"] // profile.param_bytes).n_chunks)
            try:
                evaluate(profile, hw, Knobs(**fixed), config, check_fit=True)
            except InfeasibleError as e:
                return InfeasibleError(f"the pinned plan does not work: {e}",
                                       device_needed=e.device_needed, host_needed=e.host_needed)
        if "buffers_needed" in stats:
            return InfeasibleError(
                f"pinned n_buffer={config.pins.n_buffer} is too few: with these chunks a part of the "
                f"model spans {stats['buffers_needed']} chunks, which must be on the device together. "
                f"Pin n_buffer >= {stats['buffers_needed']}, a larger chunk_size, or leave n_buffer on auto")
        if free is not None:
            return InfeasibleError(
                f"no plan fits with the pinned knobs {pins}; without pins the planner finds "
                f"{free.knobs} ({fmt_bytes(free.prediction.peak_device_bytes)} peak). Unpin "
                f"(set to \"auto\") or change the pinned values")
    if "host_needed" in stats:
        need = int(stats["host_needed"])
        return InfeasibleError(
            f"host memory too small: the offloaded model states "
            f"({_state_bytes(profile, config).host} bytes per offloaded parameter) "
            f"need at least {fmt_bytes(need)} of host memory, but {fmt_bytes(hw.host_memory)} is "
            f"available. Add host memory (or raise protrain.host_memory / --host-memory if the "
            f"machine has more), shard the states over more data-parallel ranks, or train a "
            f"smaller model.", host_needed=need)
    need, states = _leanest(profile, config, acts, caps, hw.host_memory)
    device_needed = int(np.ceil(need * (1 + margin)))
    msg = (f"device memory too small: the leanest plan that fits {fmt_bytes(hw.host_memory)} of "
           f"host memory (blocks checkpointed or swapped, as many chunks offloaded as the host "
           f"takes) peaks at {fmt_bytes(need)}, so it needs {fmt_bytes(device_needed)} with the "
           f"{margin:.0%} margin, but {fmt_bytes(hw.device_memory)} is available.")
    unbounded, _ = _leanest(profile, config, acts, caps, np.inf)
    if unbounded * (1 + margin) <= hw.device_memory:
        msg += (f" With more host memory it would fit: offloading every chunk needs "
                f"{fmt_bytes(profile.total_params * _state_bytes(profile, config).host)} of host memory.")
    fit = None
    act = need - states
    mb = profile.micro_batch
    if act > 0 and budget > states:
        scale = (budget - states) / act
        if mb:
            fit = int(np.floor(mb * scale))
            msg += (f" Lower the micro-batch from {mb} to {fit} or less" if fit >= 1 else
                    " Even micro-batch 1 does not fit; shorten the sequence")
            if profile.seq_len:
                msg += (f" (or the sequence length from {profile.seq_len} to about "
                        f"{int(profile.seq_len * min(scale, 1.0))})")
            msg += "."
        else:
            msg += f" Shrink the activations (micro-batch or sequence length) to {scale:.0%} or less."
    else:
        msg += (f" The model states alone need {fmt_bytes(states)}: use a device with more memory, "
                f"more host memory, or shard over more data-parallel ranks.")
    return InfeasibleError(msg, device_needed=device_needed, micro_batch_fit=fit if fit else None)

