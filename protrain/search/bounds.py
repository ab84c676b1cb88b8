"""Lower bounds on a plan's step time: the search simulates candidates in their order and
stops once no remaining bound can beat the best time found. Each is a resource alone -
compute, each copy queue, the activation writes, the CPU optimizer - or a chain of them the
time model (cost.time_model) cannot shorten, so each holds for every plan, not only near the
optimum (tests/test_search.py checks every one against the simulation)."""
from __future__ import annotations

import numpy as np

from ..block_mode import CKPT, CKPT_HOST, CKPT_SSD, SEL, SSD, SWAP, full_recompute
from ..config import PlannerConfig
from ..cost.chunk_times import (backup_times, check_times, chunk_transfer_times, device_optimizer_floor,
                                state_io_times)
from ..cost.host_share import rank_rates
from ..cost.memory import part_modes
from ..cost.time_queues import activation_copy_times
from ..profile.hardware import HardwareProfile
from ..state_tier import STAGING_SLOTS
from ..profile.model_profile import ModelProfile
from .candidates import ActivationConfigs, CandidateGrid
from .policy import checks_on_host, speculation_max, speculative_writes, weak_cpu_bound
from .sharding import most_sharded


def activation_chains(profile: ModelProfile, hw: HardwareProfile, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) per block layout ``codes`` [K, n_blocks]: lower bounds on each
    phase from its compute chained with its activations' copies, the step-time model's own
    recurrences (cost.time_forward, cost.time_backward) with every chunk resident and nothing
    else on the copy queues. Forward: part p >= 2 starts after block part p - 2's write, each
    write after its block's forward and the writes before it on its queue. Backward: a block's
    read is issued as the part after it starts its backward, on its queue after the reads
    before it, and the block's recompute and backward wait for it. The model is max-plus (every
    time a max of earlier times plus a duration), so leaving out the uploads, the gradient
    copies and their waits only makes each time earlier: a bound for every plan. Where a plan
    swaps or writes many blocks, forward and backward run at the copies' pace, not at the
    compute's (a 70B model with 10 blocks on the drive and 28 swapped: forward 23.9 s against
    18.7 s for its writes alone, backward 36.5 s against 24.7 s of compute)."""
    return forward_chain(profile, hw, codes), backward_chain(profile, hw, codes)


def _copies(profile: ModelProfile, hw: HardwareProfile, codes: np.ndarray):
    """(per-part modes [parts, K], bytes copied, NVMe write and read seconds, whether the part
    swaps, whether it goes to the drive) for ``activation_chains``."""
    modes = part_modes(profile, codes).T                       # [parts, K]
    saved, w_time, r_time = activation_copy_times(profile, hw, modes)
    return (modes, saved, w_time, r_time, (modes == SWAP) | (modes == CKPT_HOST),
            (modes == SSD) | (modes == CKPT_SSD))


def forward_chain(profile: ModelProfile, hw: HardwareProfile, codes: np.ndarray) -> np.ndarray:
    """``activation_chains``' forward."""
    parts = profile.parts
    modes, saved, w_time, _, swaps, drives = _copies(profile, hw, codes)
    k = modes.shape[1]
    rr = rank_rates(hw)
    serial, gds = hw.copy_engines <= 0, hw.nvme_gds
    comp, d2h, ssd_w = np.zeros(k), np.zeros(k), np.zeros(k)
    out = np.zeros((len(parts), k))                            # the part's write done at
    for p, part in enumerate(parts):
        if p >= 2:
            comp = np.maximum(comp, out[p - 2])
        comp = comp + part.fwd_time
        if part.kind != "block":
            continue
        sw, sd = swaps[p], drives[p]
        end = np.maximum(d2h, comp) + saved[p] / rr.d2h
        d2h = np.where(sw, end, d2h)
        out[p] = np.where(sw, end, 0.0)
        if serial:
            comp = np.where(sw, end, comp)
        if sd.any():
            queue = ssd_w if gds else d2h
            end = np.maximum(queue, comp) + w_time[p]
            if gds:
                ssd_w = np.where(sd, end, ssd_w)
            else:
                d2h = np.where(sd, end, d2h)
            out[p] = np.where(sd, end, out[p])
    return comp


def backward_chain(profile: ModelProfile, hw: HardwareProfile, codes: np.ndarray) -> np.ndarray:
    """``activation_chains``' backward."""
    parts = profile.parts
    modes, saved, _, r_time, swaps, drives = _copies(profile, hw, codes)
    k = modes.shape[1]
    rr = rank_rates(hw)
    serial, gds = hw.copy_engines <= 0, hw.nvme_gds
    comp, h2d, ssd_r = np.zeros(k), np.zeros(k), np.zeros(k)
    back = np.zeros((len(parts), k))                           # the part's read done at
    for p in range(len(parts) - 1, -1, -1):
        part, m = parts[p], modes[p]
        start = comp
        if serial and p >= 1 and parts[p - 1].kind == "block":
            comp = comp + np.where(swaps[p - 1], saved[p - 1] / rr.h2d, 0.0)
        comp = np.where(swaps[p] | drives[p], np.maximum(comp, back[p]), comp)
        full = (m == CKPT) | (m == CKPT_HOST) | (m == CKPT_SSD)
        comp = comp + np.where(full, part.fwd_time, np.where(m == SEL, part.sel_recompute_time, 0.0)) \
            + part.bwd_time
        if p >= 1 and parts[p - 1].kind == "block":
            b = p - 1
            end = np.maximum(h2d, start) + saved[b] / rr.h2d
            h2d = np.where(swaps[b], end, h2d)
            back[b] = np.where(swaps[b], end, 0.0)
            if drives[b].any():
                queue = ssd_r if gds else h2d
                end = np.maximum(queue, start) + r_time[b]
                if gds:
                    ssd_r = np.where(drives[b], end, ssd_r)
                else:
                    h2d = np.where(drives[b], end, h2d)
                back[b] = np.where(drives[b], end, back[b])
    return comp


def _suffix(t: np.ndarray) -> np.ndarray:
    """sum_{c >= n} t[c], at index n."""
    return np.concatenate([np.cumsum(t[::-1])[::-1], [0.0]])


def step_lower_bound(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig,
                     acts: ActivationConfigs, layout, a_idx, np_idx, nb, host, n_nvme=0, *, nvme_most=None,
                     n_shard=0):
    """A lower bound on the time of an optimizer step for points (activation configuration
    ``a_idx``, ``np_idx`` persistent chunks, ``nb`` buffers, ``host`` bytes of host memory,
    ``n_nvme`` chunks with states on the drive, ``n_shard`` of the persistent ones sharded: the
    most a point may have, for a floor over points; the gathers of sharded chunks are left
    out, they only add): each resource alone (see cost.time_model for
    the queues; states on the drive only delay CPU Adam's updates, and the drive is a floor),
    for the boundary micro-step and for the (gas - 1) others. Returns (bound, forward's part, the device's backward and optimizer,
    the accumulation micro-steps): the parts ``refine_cpu_bound`` rebuilds it from.
    ``nvme_most``: for a set of points (pairs.pair_space), at least each one's chunks on the
    drive, where ``n_nvme`` is at most each one's (the drive's floor rises with them, the
    verdict's chain falls)."""
    world = config.data_parallel_size
    nch = layout.n_chunks
    t_up, t_down, t_adam = chunk_transfer_times(layout, profile, hw, world)
    rr = rank_rates(hw)
    up_suffix = _suffix(t_up)
    fwd_compute = sum(p.fwd_time for p in profile.parts)
    bwd_compute = sum(p.bwd_time for p in profile.parts) + acts.recompute[a_idx]
    swap_bytes = acts.swap_host[a_idx]
    gpu = device_optimizer_floor(layout, hw, world, np_idx, n_shard)
    fwd_lb = np.maximum(np.maximum(fwd_compute, up_suffix[np_idx]), acts.fwd_write[a_idx])
    reup = up_suffix[np_idx] - up_suffix[np.maximum(nch - nb, np_idx)]
    ssd_in = acts.ssd[a_idx] / rr.nvme_read if rr.nvme_read > 0 else 0.0
    if hw.nvme_gds:
        bwd_lb = np.maximum(np.maximum(bwd_compute, reup + swap_bytes / rr.h2d), ssd_in)
    else:   # bounced through the host: on the upload queue with the chunk re-uploads
        bwd_lb = np.maximum(bwd_compute, reup + swap_bytes / rr.h2d + ssd_in)
    bwd_lb = np.maximum(bwd_lb, acts.bwd_read[a_idx])
    adam = _suffix(t_adam)[np_idx]
    cpu_lb = _cpu_optimizer_bound(profile, hw, config, layout, np_idx, nb, host, fwd_lb, bwd_lb,
                                  t_down, adam, n_nvme if nvme_most is None else nvme_most)
    lb = np.maximum(fwd_lb + np.maximum(bwd_lb + gpu, cpu_lb),
                    drive_bound(layout, profile, hw, config, acts.ssd[a_idx], n_nvme))
    tail = np.zeros(len(lb))
    if config.grad_accumulation_steps > 1:
        # A micro-step without the optimizer ends with backward's compute (cost.time_model does
        # not wait for the last gradient copies there), so the D2H queue is no bound on it.
        tail = (config.grad_accumulation_steps - 1) * (fwd_lb + bwd_lb)
        lb = lb + tail
    return lb, fwd_lb, bwd_lb + gpu, tail


def degree_floor(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig, layout,
                 n_persist: np.ndarray) -> np.ndarray:
    """A lower bound on ``step_lower_bound`` (so on the step) of every point of ``layout`` with
    ``n_persist`` persistent chunks, whatever its activation configuration, buffers and chunks
    on the drive: forward's compute or its uploads, backward's compute without recompute and
    the device's optimizer, for every micro-step; or CPU Adam over the offloaded chunks, with
    the verdict checks where it waits for them (``weak_cpu_bound``), then the other
    micro-steps. Each term is one ``step_lower_bound`` adds or takes the largest of, with the
    terms that depend on the rest of the point left out (they only add). Needs no candidate
    grid: the sequence-parallel loop skips a degree this rules out (``search_floor``)."""
    world = config.data_parallel_size
    n_persist = np.asarray(n_persist)
    t_up, _, t_adam = chunk_transfer_times(layout, profile, hw, world)
    fwd = np.maximum(sum(p.fwd_time for p in profile.parts), _suffix(t_up)[n_persist])
    bwd = sum(p.bwd_time for p in profile.parts)
    gpu = device_optimizer_floor(layout, hw, world, n_persist, most_sharded(config, layout, n_persist))
    cpu = _suffix(t_adam)[n_persist] + (host_checks(layout, hw, config, n_persist)
                                        if weak_cpu_bound(config, hw) else 0.0)
    return np.maximum(fwd + bwd + gpu, cpu) + (config.grad_accumulation_steps - 1) * (fwd + bwd)


def drive_bound(layout, profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig, ssd,
                n_nvme) -> np.ndarray:
    """The drive's floor under a step with states on it (``cost.time_state_io.drive_floor``):
    the states of the last ``n_nvme`` chunks and ``ssd`` bytes of activations, read and
    written at this rank's share of the drive; 0 without states there."""
    n_nvme = np.asarray(n_nvme)
    if not n_nvme.any():
        return np.zeros(np.shape(ssd))
    rr = rank_rates(hw)
    t_read, t_write = state_io_times(layout, hw, config.data_parallel_size, profile.param_bytes < 4,
                                     speculative_writes(config))
    top = lambda t: np.concatenate([[0.0], np.cumsum(t[::-1])])   # noqa: E731  (last k chunks)
    reads, writes = top(t_read)[n_nvme] + ssd / rr.nvme_read, top(t_write)[n_nvme] + ssd / rr.nvme_write
    floor = np.maximum(reads, writes) if hw.nvme_duplex else reads + writes
    return np.where(n_nvme > 0, floor, 0.0)


def _cpu_optimizer_bound(profile, hw, config, layout, np_idx, nb, host, fwd_lb, bwd_lb, t_down, adam,
                         n_nvme):
    """The part of ``step_lower_bound`` after forward that CPU Adam (``adam``: its time over the
    offloaded chunks) cannot beat."""
    nch = layout.n_chunks
    if weak_cpu_bound(config, hw):
        # Updates left for after backward run on into the next forward (cost.time_model's
        # carry_over): the step is at least the device's work and at least CPU Adam's, with
        # the verdict checks when there are (clipping / fp16).
        checks = host_checks(layout, hw, config, np_idx)
        cpu_lb = adam + checks - fwd_lb
        if config.cpu_optim_overlap:
            cpu_lb = np.maximum(cpu_lb, carried_floor(profile, layout, hw, config.data_parallel_size)[np_idx]
                                - fwd_lb)
        if not config.cpu_optim_overlap:
            world = config.data_parallel_size
            sb = SpeculatingIterationBound(profile, layout, hw, config, np_idx,
                                           backward_bound(profile, layout, hw, world, np_idx, nb, bwd_lb),
                                           checks, n_nvme)
            s_max = speculation_max(layout, hw, config, np_idx, host, n_nvme)
            cpu_lb = np.maximum(cpu_lb, (sb.at(s_max) if config.speculate_chunks is not None
                                         else sb.least(s_max)) - fwd_lb)
        return cpu_lb
    if config.cpu_optim_overlap:
        # CPU Adam starts at the earliest once the last chunk's gradient is complete (after
        # the backward of the parts from its first user on) and has left the device.
        first = layout.chunk_first_part[nch - 1] if nch else 0
        head = sum(p.bwd_time for p in profile.parts[first:]) + (t_down[-1] if nch else 0.0)
        return np.maximum(np.where(np_idx < nch, head + adam, 0.0), _suffix(t_down)[np_idx])
    return bwd_lb + adam


class SpeculatingIterationBound:
    """A lower bound on the iteration of a plan whose CPU Adam waits for the step's verdict
    (clipping / fp16) and runs on into the next forward, for each count s of speculating
    chunks (the top s offloaded ones: cost.time_model backs each up, then updates it, during
    backward). Counted from one forward's end to the next, with c the chunk whose update the
    CPU does last (n - s - 1, the last left for after backward in chunk order; with every
    offloaded chunk speculating, the lowest), and the next forward's upload of c starting
    at least the uploads of chunks c..n-1, or c's upload and the forward compute after c's
    first user, before that forward ends (``up_next``), the iteration is at least
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
    only lowers it). Chunks with states on the drive (the last ``n_nvme``) need no backup:
    ``at`` and ``least`` count those of the others among the top s. Their reads and
    write-backs are left out: the CPU queue interleaves them with the chunks in host memory
    (``cost.time_state_io``), and the drive's time is a bound of its own (``drive_bound``). For a model
    bound by its CPU Adam this lies within a few hundredths of a per cent of the simulated time, where the CPU's busy time alone leaves out the backups,
    the updates after backward and the copies around them."""

    def __init__(self, profile: ModelProfile, layout, hw: HardwareProfile, config: PlannerConfig,
                 n_persist, backward, checks, n_nvme=0):
        world = config.data_parallel_size
        nch = layout.n_chunks
        t_up, t_down, t_adam = chunk_transfer_times(layout, profile, hw, world)
        top = lambda t: np.concatenate([[0.0], np.cumsum(t[::-1])])    # noqa: E731  (last s chunks)
        self.adam_top = top(t_adam)
        self.backup_top = top(backup_times(layout, hw, t_adam, world))
        # What the next forward has left once it starts the upload of c = n - s - 1, the chunk
        # updated last: the uploads of c and the chunks above it, and (``upload_tail``) c's
        # upload then the forward compute of the parts after c's first user - the compute
        # dominates where c is deep (a 70B model: seconds against milliseconds). A count's
        # value is the least over the counts above it: the update done last may be one of a
        # lower chunk (interleaved with the drive's: ``_last_in_host``), and ``least`` needs
        # a side that never falls.
        up = np.concatenate([top(t_up)[1:], [0.0]])                       # uploads of the last s + 1
        up[:nch] = np.maximum(up[:nch], upload_tail(profile, layout, t_up)[::-1])
        up[:nch] = np.minimum.accumulate(up[:nch][::-1])[::-1]
        self.up_next = up
        self.n_off = nch - np.asarray(n_persist)
        self.adam = self.adam_top[self.n_off]
        self.backward, self.checks = backward, checks
        self.n_nvme = np.broadcast_to(np.asarray(n_nvme), np.shape(self.n_off))
        self.backup_shift = self.backup_top[self.n_nvme]
        self.t_adam, self.tail = t_adam, upload_tail(profile, layout, t_up)
        lead = first_gradient(profile, layout) + (t_down[-1] if nch else 0.0)
        self.lead = np.where(self.n_off > 0, lead, 0.0)
        # What every count's chain shares, summed in _chain's order (the same floats).
        self._base = self.lead + self.adam + self.checks
        self._offloading = self.n_off > 0
        self._last = np.maximum(self.n_off - 1, 0)

    def _uploads(self, s, rows=...):
        """Uploads from the chunk the CPU updates last to the end (none without offloading)."""
        return np.where(self._offloading[rows], self.up_next[np.minimum(s, self._last[rows])], 0.0)

    def _chain(self, s, backups, rows=...):
        return self._base[rows] + backups + self._uploads(s, rows)

    def at(self, s, rows=...):
        """The bound with the top ``s`` offloaded chunks speculating (of plans ``rows``)."""
        n_off, n_nvme = self.n_off[rows], self.n_nvme[rows]
        backward = np.broadcast_to(self.backward, np.shape(self.n_off))[rows]
        after = np.where(s < n_off, backward + self.adam[rows] - self.adam_top[s] + self.up_next[s],
                         backward)
        backups = self.backup_top[s] - self.backup_top[np.minimum(s, n_nvme)]
        return np.maximum(self._chain(s, backups, rows), after)

    def _last_in_host(self, s, n_off, n_nvme, backward, adam):
        """``after``'s chain through the highest chunk in host memory the step leaves for after
        backward, h: the CPU takes those lowest first, interleaved in proportion with the D left
        on the drive (``time_state_io.nvme_turn``), so at most ceil(D / H) - 1 of the drive's
        follow h's update (H: those in host memory), and one of them may run before the last
        gradient lands; h's upload in the next forward waits for its update, and that forward
        has at least ``upload_tail`` left. Where states on the drive are interleaved, the last
        update is often h, low in the next forward's order (a 70B model, 91 of 312 chunks on the
        drive: 3 s of forward after it)."""
        n = len(self.adam_top) - 1
        deep = np.maximum(n_nvme, s)                        # the chunks above h
        held = n_off - deep                                 # H
        drive = np.maximum(n_nvme - s, 0)                   # D
        trail = np.where(drive > 0, -(-drive // np.maximum(held, 1)) - 1, 0)
        first = np.where(drive > 0, self.t_adam[np.clip(n - n_nvme, 0, n - 1)], 0.0)
        work = adam - self.adam_top[np.minimum(s + trail, n)] - first
        h = np.clip(n - deep - 1, 0, max(n - 1, 0))
        tail = self.tail[h] if n else np.zeros(np.shape(h))
        return np.where((held > 0) & (s < n_off), backward + work + tail, -np.inf)

    def with_reads(self, s_max, t_read, t_write, *, shared: bool, pinned: bool) -> np.ndarray:
        """Per plan: the least over s in [0, s_max] (at s_max where ``pinned``) of ``at(s)``,
        ``chain_after_reads`` (``refine_speculating_reads``) and ``_last_in_host``. Every term
        is either the same for the plans of one (offloaded chunks, chunks on the drive, s_max)
        - A(s) - or their backward plus one - B(s): a [groups, counts] table of each (a search
        batch of 4 k points holds about 200 groups), and per plan the least over s of
        max(A(s), backward + B(s)), found by bisection over the counts sorted by A - B."""
        plans = len(self.n_off)
        s_max = np.broadcast_to(np.asarray(s_max), (plans,))
        span = len(self.adam_top) + 1                  # each of the three lies in [0, span)
        _, rep, grp = np.unique((self.n_off.astype(np.int64) * span + self.n_nvme) * span + s_max,
                                return_index=True, return_inverse=True)
        grp = grp.reshape(-1)
        keys = np.stack([self.n_off[rep], self.n_nvme[rep], s_max[rep]])
        # The counts no plan may take are left out of the table (a 206B model: 13 of 500).
        s = np.arange(min(int(s_max.max(initial=0)), len(self.adam_top) - 1) + 1)[None, :]
        n_off, nv, sm = (k[:, None] for k in keys)
        adam = self.adam[rep][:, None]
        lead, base = self.lead[rep][:, None], self._base[rep][:, None]
        after = np.where(s < n_off, adam - self.adam_top[s] + self.up_next[s], 0.0)
        backups = self.backup_top[s] - self.backup_top[np.minimum(s, nv)]
        uploads = np.where(self._offloading[rep][:, None], self.up_next[np.minimum(s, self._last[rep][:, None])], 0.0)
        chain = base + backups + uploads
        # chain_after_reads: the k-th speculating chunk on the drive starts once its read is
        # done; the CPU has the updates from it on, the backups and the uploads still to do.
        top = lambda t: np.concatenate([[0.0], np.cumsum(t[::-1])])    # noqa: E731  (last k chunks)
        k = np.minimum(s, nv)
        ready = lead + top(t_read)[k]
        if shared:
            ready = ready + top(t_write)[np.maximum(k - STAGING_SLOTS, 0)]
        drive = np.where(k > 0, ready + adam - self.adam_top[np.maximum(k - 1, 0)] + backups + uploads, -np.inf)
        fixed = np.maximum(chain, drive)                                     # A(s)
        rising = np.maximum(after, self._last_in_host(s, n_off, nv, 0.0, adam))  # B(s)
        bw = np.broadcast_to(self.backward, (plans,))
        if pinned:
            at = np.minimum(s_max, self.n_off)
            return np.maximum(fixed[grp, at], bw + rising[grp, at])
        valid = (s <= sm) & (s <= n_off)
        fixed = np.where(valid, fixed, np.inf)
        # max(A, b + B) is A while b <= A - B, b + B above: sorted by A - B, the least is the
        # least A of the counts at or above b, or b + the least B of those below.
        turn = np.where(valid, fixed - rising, np.inf)
        order = np.argsort(turn, axis=1, kind="stable")
        turn = np.take_along_axis(turn, order, axis=1)
        a_above = np.minimum.accumulate(np.take_along_axis(fixed, order, axis=1)[:, ::-1], axis=1)[:, ::-1]
        a_above = np.concatenate([a_above, np.full((len(rep), 1), np.inf)], axis=1)
        b_below = np.minimum.accumulate(np.where(np.isfinite(turn), np.take_along_axis(rising, order, axis=1), np.inf),
                                        axis=1)
        b_below = np.concatenate([np.full((len(rep), 1), np.inf), b_below], axis=1)
        lo, hi = np.zeros(plans, dtype=np.int64), np.full(plans, turn.shape[1], dtype=np.int64)
        while (lo < hi).any():                      # lo: the counts whose A - B is below b
            active = lo < hi
            mid = (lo + hi) // 2
            below = turn[grp, np.minimum(mid, turn.shape[1] - 1)] < bw
            lo = np.where(active & below, mid + 1, lo)
            hi = np.where(active & ~below, mid, hi)
        return np.minimum(a_above[grp, lo], bw + b_below[grp, lo])

    def least(self, s_max):
        # s < n_off: after(s) >= backward + adam - fall[s], fall nondecreasing; chain(s) >= it
        # from s_cross on.
        fall = np.maximum.accumulate(self.adam_top - self.up_next)
        s_lim = np.minimum(s_max, self.n_off - 1)
        # The backups of the top s: none up to n_nvme, then those above it - the crossing in
        # the first range, else in the second (both searches over one array for every plan).
        rise = self.up_next + fall
        goal = self.backward - self.checks - self.lead
        s_cross = np.searchsorted(rise, goal, side="left")
        beyond = np.flatnonzero(s_cross > self.n_nvme)
        s_cross[beyond] = np.searchsorted(self.backup_top + self.up_next + fall,
                                          goal[beyond] + self.backup_shift[beyond], side="left")
        hi = np.maximum(s_lim, 0)
        ahead = self.backward + self.adam
        v = []
        for s in (s_cross - 1, s_cross):
            s = np.minimum(np.maximum(s, 0), hi)
            v.append(np.maximum(self._chain(s, np.maximum(self.backup_top[s] - self.backup_shift, 0.0)),
                                ahead - fall[s]))
        best = np.where(s_lim >= 0, np.minimum(v[0], v[1]), np.inf)
        every = np.flatnonzero(np.broadcast_to(s_max >= self.n_off, best.shape))
        best[every] = np.minimum(best[every], self.at(self.n_off[every], every))
        return best


def carried_floor(profile: ModelProfile, layout, hw: HardwareProfile, world: int) -> np.ndarray:
    """Per n_persist: a lower bound on the iteration of a plan whose CPU Adam overlaps backward
    and carries its leftovers into the next forward (cost.time_step_end: the iteration is at
    least, for the chunk c updated last, its update's end less the next forward's start of c's
    upload). The CPU starts no update before the first gradient has landed (``first_gradient``
    after forward's end, then the top chunk's copy down) and then has every update to run, so
    the last ends at least forward's end + that lead + CPU Adam over the offloaded chunks; c's
    upload started at the latest c's upload time and the forward compute of the parts after
    c's first user before forward's end. Where the bound counted CPU Adam's busy time alone,
    a CPU-bound model left thousands of plans within a fraction of a per cent of the best and
    the search simulated them all (70B with a drive: 167 k simulations)."""
    nch = layout.n_chunks
    t_up, t_down, t_adam = chunk_transfer_times(layout, profile, hw, world)
    late = upload_tail(profile, layout, t_up)
    least_late = np.concatenate([np.minimum.accumulate(late[::-1])[::-1], [0.0]])   # min over c >= n
    lead = first_gradient(profile, layout) + (t_down[-1] if nch else 0.0)
    out = lead + _suffix(t_adam) + least_late
    out[nch] = 0.0
    return out


def upload_tail(profile: ModelProfile, layout, t_up: np.ndarray) -> np.ndarray:
    """[chunks] the least of forward left once chunk c's upload starts: the upload, then the
    forward compute of the parts after its first user (they run after it)."""
    fwd_after = np.concatenate([np.cumsum([p.fwd_time for p in profile.parts][::-1])[::-1], [0.0]])
    if not layout.n_chunks:
        return np.zeros(0)
    return t_up + fwd_after[np.asarray(layout.chunk_first_part, dtype=np.int64) + 1]


def backward_compute(profile: ModelProfile, codes: np.ndarray) -> np.ndarray:
    """Backward's compute per plan: every part's backward plus the recomputed forwards."""
    fwd = np.array([b.fwd_time for b in profile.blocks])
    sel = np.array([b.sel_recompute_time for b in profile.blocks])
    return sum(p.bwd_time for p in profile.parts) + full_recompute(codes).astype(np.float64) @ fwd + \
        (codes == SEL).astype(np.float64) @ sel


def backward_bound(profile, layout, hw, world, n_persist, n_buffer, bwd) -> np.ndarray:
    """A lower bound on the time from forward's end until backward is over and every
    offloaded gradient is on the host (SpeculatingIterationBound's ``backward``): ``bwd`` (a bound on
    backward alone: its compute, or more), the re-uploads (issued in backward), the gradient
    copies (one queue, from the first gradient)."""
    t_up, t_down, _ = chunk_transfer_times(layout, profile, hw, world)
    up = np.concatenate([np.cumsum(t_up[::-1])[::-1], [0.0]])
    down = np.concatenate([np.cumsum(t_down[::-1])[::-1], [0.0]])
    reup = up[n_persist] - up[np.maximum(layout.n_chunks - n_buffer, n_persist)]
    return np.maximum(np.maximum(bwd, reup), first_gradient(profile, layout) + down[n_persist])


def first_gradient(profile, layout) -> float:
    """Backward's compute before the first gradient copy can start: the parts from the last
    chunk's first user on (recompute left out: a bound for every plan)."""
    first = layout.chunk_first_part[layout.n_chunks - 1] if layout.n_chunks else len(profile.parts)
    return sum(p.bwd_time for p in profile.parts[first:])


def host_checks(layout, hw: HardwareProfile, config: PlannerConfig, n_persist):
    """CPU time of the verdict checks over the offloaded chunks, where they are taken on the
    host (accumulated gradients under clipping / fp16); 0 elsewhere."""
    if config.cpu_optim_overlap or not checks_on_host(config):
        return 0.0
    suffix = np.concatenate([np.cumsum(check_times(layout, hw, config.data_parallel_size)[::-1])[::-1], [0.0]])
    return suffix[np.asarray(n_persist)]


def refine_cpu_bound(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig,
                      acts: ActivationConfigs, grid: CandidateGrid, idx: np.ndarray) -> np.ndarray:
    """A tighter lower bound for points ``idx`` of ``grid`` when CPU Adam overlaps backward,
    computed only for the points about to be simulated (it needs their block layouts).

    CPU Adam steps the offloaded chunks one at a time in the order their gradients complete
    (descending index), so for every offloaded chunk c the CPU is busy until at least the
    backward (with its recompute) of the parts from c's first user on, plus c's gradient
    offload, plus Adam over c and every offloaded chunk below it. Near the optimum of a
    CPU-bound model thousands of plans differ by less than the slack of the coarse bound
    (which counts only the last chunk and no recompute); this one tells them apart."""
    if not len(idx):
        return grid.lower_bound[idx]
    if speculating_reads(config, hw, grid):
        return refine_speculating_reads(profile, hw, config, grid, idx)
    if not config.cpu_optim_overlap or weak_cpu_bound(config, hw):
        return grid.lower_bound[idx]
    layout = grid.layout
    nch = layout.n_chunks
    _, t_down, t_adam = chunk_transfer_times(layout, profile, hw, config.data_parallel_size)
    codes = acts.codes(grid.a[idx])
    fwd = np.array([b.fwd_time for b in profile.blocks])
    sel = np.array([b.sel_recompute_time for b in profile.blocks])
    per_part = np.tile(np.array([p.bwd_time for p in profile.parts]), (len(idx), 1))
    per_part[:, list(profile.block_part_indices)] += np.where(full_recompute(codes), fwd, 0.0) + \
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


def speculating_reads(config: PlannerConfig, hw: HardwareProfile, grid: CandidateGrid) -> bool:
    """Whether ``refine_speculating_reads`` may raise the bounds of ``grid``'s points."""
    return (not config.cpu_optim_overlap and weak_cpu_bound(config, hw) and config.cpu_optim_speculative
            and bool((grid.n_nvme > 0).any()))


def refine_speculating_reads(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig,
                             grid: CandidateGrid, idx: np.ndarray) -> np.ndarray:
    """A tighter lower bound for points ``idx`` of ``grid`` whose CPU Adam waits for the step's
    verdict and speculates (``SpeculatingIterationBound``), where some keep states on the
    drive: the speculating chunks are the top ones, so the first to speculate are those on the
    drive, each update after its states' read. The read of the k-th of them ends at least the
    first gradient's landing plus the reads of the k and, on a drive whose reads and writes
    share its time, the write-backs of the uses ``STAGING_SLOTS`` before it (their buffers
    free before its read is issued: ``cost.time_state_io``); then the CPU has every update
    from the k-th on, the backups and the uploads ahead (``chain_after_reads``). The least
    over the counts s the point may speculate with of the three chains. Computed for the
    points about to be simulated: a [points, counts] table. Where the drive's reads outpace
    the speculating updates, this is the bound (8 ranks of a 70B model with most states on
    a drive: thousands of plans bound within 0.3% of the best, simulated 4% slower)."""
    base = grid.lower_bound[idx]
    nv = grid.n_nvme[idx]
    layout = grid.layout
    world = config.data_parallel_size
    npi, nb = grid.n_persist[idx], grid.n_buffer[idx]
    gpu = device_optimizer_floor(layout, hw, world, npi, grid.n_shard[idx])
    bwd_lb = grid.dev_lb[idx] - gpu
    checks = host_checks(layout, hw, config, npi)
    sb = SpeculatingIterationBound(profile, layout, hw, config, npi,
                                   backward_bound(profile, layout, hw, world, npi, nb, bwd_lb), checks, nv)
    s_max = speculation_max(layout, hw, config, npi, grid.host[idx], nv)
    t_read, t_write = state_io_times(layout, hw, world, profile.param_bytes < 4, speculative_writes(config))
    bound = sb.with_reads(s_max, t_read, t_write, shared=not hw.nvme_duplex,
                          pinned=config.speculate_chunks is not None)
    return np.maximum(base, bound + grid.tail_lb[idx])
