"""Runtime cost model: predicted iteration time of a plan. Pure, vectorized over plans.

    T_iter = max(T_fwd + T_bwd + T_gpu_optim, end of the last CPU Adam step)

which is ProTrain's T_fwd + max(T_bwd + T_gpu_optim, T_cpu_optim) with the CPU steps placed
where they can start. T_fwd and T_bwd come from a small event simulation of four queues that
run concurrently - device compute, the host-to-device copy engine, the device-to-host copy
engine and the CPU optimizer - in the order the runtime issues work:

forward, part by part (pre, blocks, post), each part's compute split over the chunks it uses:
- a non-persistent chunk is uploaded (H2D) into a buffer as early as both the copy engine and
  a free buffer allow: chunk c reuses the buffer of chunk c - n_buffer, free once the last part
  using that chunk has finished; compute on a chunk waits for its upload. With enough buffers
  this is the per-chunk max(compute, transfer) of the paper; with too few, the wait shows.
- a SWAP block's saved activations go D2H after its forward; at most one swapped block may be
  in flight, so part k+1 cannot start before the swap-out of part k-1 is done.
backward, parts in reverse, chunks in reverse:
- the last n_buffer non-persistent chunks are still in their buffers and are reused; the
  others are uploaded again, chunk c into the buffer of chunk c + n_buffer once that chunk's
  gradient has left the device;
- a SWAP block's activations are prefetched (H2D) when the next part's backward starts; they
  share the copy engine with chunk uploads, in issue order - this is how swapping competes
  with parameter prefetch for PCIe;
- a CKPT block first recomputes its forward (all its chunks resident), then runs backward; a
  SELECTIVE block recomputes its forward without attention and all-to-alls
  (PartProfile.sel_recompute_time);
- when the first part using a chunk has finished backward, the chunk's gradient is complete:
  non-persistent chunks go D2H, then to CPU Adam (one chunk at a time), overlapping backward;
- persistent chunks are updated by the device's fused Adam after backward (T_gpu_optim).
SSD blocks (SSDTrain) behave as swapped ones, with the NVMe bandwidth: with GPUDirect Storage
their writes and reads have queues of their own; in compatibility mode they bounce through the
host and occupy the D2H / H2D queues.

Copy concurrency (``HardwareProfile.copy_engines``): with one copy engine the two copy queues
are one FIFO; with none (a CPU "device") every copy and every CPU Adam step runs on the
compute timeline where the runtime issues it, so offloading costs its full transfer time -
unless CPU Adam has a thread of its own (``HardwareProfile.cpu_adam_thread``: a CPU "device"
whose runtime runs CPU Adam on its worker thread, on a core of its own).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..block_mode import CKPT, SEL, SSD, SWAP
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from .host_share import rank_rates
from ..layout import ChunkLayout
from .memory import offload_bytes, part_modes


@dataclass(frozen=True, slots=True)
class TimePrediction:
    """Seconds; every field is an array with one entry per plan simulated."""

    iter_time: np.ndarray
    fwd_time: np.ndarray
    """End of forward (compute of the post part)."""
    bwd_time: np.ndarray
    """From end of forward to end of backward compute (recompute and copy waits included)."""
    gpu_optim_time: np.ndarray
    """Device Adam over the persistent chunks."""
    cpu_optim_time: np.ndarray
    """CPU Adam busy time over the offloaded chunks (mostly hidden behind backward)."""
    cpu_optim_exposed: np.ndarray
    """Part of the CPU optimizer not hidden: time from the end of the device's work to the end
    of the last CPU Adam step."""
    h2d_bytes: np.ndarray
    d2h_bytes: np.ndarray
    spec_useful: np.ndarray | None = None
    """With ``speculate_from``: how many of the speculating chunks (from the first one CPU
    Adam reaches) had their backup done before backward's end - the rest would only have
    delayed the updates left for after it (``protrain.search`` chooses the count from it)."""


def chunk_transfer_times(layout: ChunkLayout, profile: ModelProfile, hw: HardwareProfile,
                         world: int = 1):
    """Per-chunk upload time, gradient offload time and CPU Adam time (seconds; the runtime's
    own time per update, ``hw.host_update_overhead``, included), at the rates one of the
    node's ``hw.ranks_per_node`` ranks gets (``cost.host_share``).

    With ``world`` data-parallel ranks an offloaded chunk is sharded: an upload is the H2D
    copy of this rank's 1/world shard followed by an all-gather of the rest; a gradient
    offload is a reduce-scatter followed by the D2H copy of the shard; CPU Adam updates the
    shard only."""
    rr = rank_rates(hw)
    used = np.asarray(layout.used, dtype=np.float64)
    nbytes = used * profile.param_bytes
    up, down, adam = nbytes / world / rr.h2d, nbytes / world / rr.d2h, \
        used / world / rr.cpu_adam + np.where(used > 0, rr.update_overhead, 0.0)
    if world > 1:
        coll = nbytes * (world - 1) / world / _collective_bandwidth(hw)
        up, down = up + coll, down + coll
    return up, down, adam


def persistent_allreduce_time(layout: ChunkLayout, n_persist, hw: HardwareProfile, world: int):
    """All-reduce of the persistent chunks' fp32 gradients at the accumulation boundary
    (ring: 2 (world - 1) / world of the bytes each way)."""
    if world <= 1:
        return np.zeros_like(np.asarray(n_persist, dtype=np.float64))
    prefix = np.concatenate([[0], np.cumsum(layout.used)])
    return prefix[np.asarray(n_persist)] * 4 * 2 * (world - 1) / world / _collective_bandwidth(hw)


def _collective_bandwidth(hw: HardwareProfile) -> float:
    if hw.collective_bandwidth <= 0:
        raise ValueError(f"{hw.name}: planning for several data-parallel ranks needs the collective "
                         f"bandwidth; probe the machine with the ranks launched, or use a named GPU")
    return hw.collective_bandwidth


def check_times(layout: ChunkLayout, hw: HardwareProfile, world: int = 1):
    """Per-chunk time to take a chunk's part of the step's verdict on the host (its parameters'
    gradient norms for clipping, or the overflow test) as its gradients land."""
    rr = rank_rates(hw)
    rate = rr.grad_check if rr.grad_check > 0 else CHECK_PER_ADAM * rr.cpu_adam
    return np.asarray(layout.used, dtype=np.float64) / world / rate


CHECK_PER_ADAM = 1.7
"""Gradient elements checked per CPU Adam update, where the check rate was not measured
(published machines): an fp32 norm against DeepSpeedCPUAdam on this project's 2-core CPU,
2.9 G elements/s against 1.7 G parameters/s (both memory-bound: a check reads 4 bytes per
element, an update reads and writes 28)."""


def backup_times(layout: ChunkLayout, hw: HardwareProfile, t_adam, world: int = 1):
    """Per-chunk time to back up master, exp_avg and exp_avg_sq (12 bytes per parameter of
    this rank's shard) before a speculative update; without a measured host copy bandwidth,
    as long as the update (the ratio measured on a 2-core CPU: bench/cpu_adam.py)."""
    host_copy = rank_rates(hw).host_copy
    if host_copy > 0:
        return np.asarray(layout.used, dtype=np.float64) * 12 / world / host_copy
    return np.asarray(t_adam, dtype=np.float64)


def simulate(profile: ModelProfile, layout: ChunkLayout, hw: HardwareProfile, n_persist,
             n_buffer, block_modes, *, optimizer_step: bool = True,
             cpu_overlap: bool = True, world: int = 1, speculate_from=None,
             speculation_wrong: bool = False, carry_over: bool = False,
             checks_on_host: bool = False, trace: list | None = None) -> TimePrediction:
    """Simulate K plans at once: n_persist[K], n_buffer[K], block_modes[K, n_blocks] (codes).

    ``optimizer_step=False`` simulates a micro-step that only accumulates gradients (no Adam
    on either side). ``cpu_overlap=False`` starts CPU Adam only once backward is over (the
    global gradient norm or the fp16 overflow check needs every gradient first); then
    ``speculate_from[K]`` (a chunk index per plan) lets chunks from that index on update
    speculatively during backward, each first backing up its states (``backup_times``);
    ``speculation_wrong``: the step clips (or overflows), so after backward every speculated
    chunk is restored from its backup and updated again, in the order of the others.
    ``checks_on_host``: the step's verdict inputs (each offloaded chunk's gradient norms for
    clipping, its overflow test) are taken on the host as its gradients land, on the CPU
    queue (accumulated gradients); else on the device before they leave it, where they are
    bandwidth-bound reads left out of the model - except on a CPU "device", where they sit on
    the compute timeline. Both only without ``cpu_overlap`` (clipping / fp16).
    ``carry_over``: CPU Adam left at the end of the step runs on into the next forward (the
    runtime's behaviour), which waits only where an offloaded chunk's upload needs its update:
    the iteration is the device's work plus that wait, and at least the CPU's busy time. The
    search ranks plans without it (its lower bounds assume CPU Adam ends within the step);
    the chosen plan's prediction includes it.

    ``trace`` (one plan): receives (lane, what, label, start, end) for every simulated piece of
    work (protrain/timeline.py draws them)."""
    # [parts, K] / [chunks, K] layouts below: the loops read and write one part or chunk of
    # every plan at a time, which is then a contiguous row.
    modes = np.ascontiguousarray(part_modes(profile, block_modes).T)
    k_plans = modes.shape[1]
    npers = np.broadcast_to(np.asarray(n_persist, dtype=np.int64), (k_plans,))
    nbuf = np.broadcast_to(np.asarray(n_buffer, dtype=np.int64), (k_plans,))
    n_chunks = layout.n_chunks
    parts = profile.parts
    rows = np.arange(k_plans)
    t_up, t_down, t_adam = chunk_transfer_times(layout, profile, hw, world)
    rr = rank_rates(hw)                        # the copy and "device" Adam rates of one rank
    spec_from = None
    # Clipping / fp16 (no overlap): each offloaded chunk's gradients are checked (norms,
    # overflow), on the host as they land (before or in its speculative update), or on the
    # device before they leave.
    t_check = check_times(layout, hw, world) if not cpu_overlap and optimizer_step else np.zeros(n_chunks)
    t_host_check = t_check if checks_on_host else np.zeros(n_chunks)
    if speculate_from is not None and not cpu_overlap:
        spec_from = np.broadcast_to(np.asarray(speculate_from, dtype=np.int64), (k_plans,))
        t_backup = backup_times(layout, hw, t_adam, world)
        t_spec = t_host_check + t_adam + t_backup
        spec_ready = np.full((n_chunks, k_plans), np.inf)   # backup of a speculating chunk done at
    saved = np.array([offload_bytes(p) for p in parts], dtype=np.float64)   # what SWAP / SSD copy
    bad = (nbuf < 1) & (npers < n_chunks)
    if bad.any():
        raise ValueError("a plan with non-persistent chunks needs at least one buffer")

    # Chunks whose last forward user / first backward user is part p.
    last_of = [[] for _ in parts]
    first_of = [[] for _ in parts]
    for c in range(n_chunks):
        last_of[layout.chunk_last_part[c]].append(c)
        first_of[layout.chunk_first_part[c]].append(c)

    zeros = np.zeros(k_plans)
    h2d_bytes = zeros.copy()
    d2h_bytes = zeros.copy()

    # ---------------- forward ----------------
    comp = zeros.copy()
    h2d = zeros.copy()
    d2h = zeros.copy()
    ready = np.zeros((n_chunks, k_plans))          # chunk resident (upload done) at
    released = np.full((n_chunks, k_plans), np.nan)  # buffer of chunk free at (forward)
    swap_out_end = np.zeros((len(parts), k_plans))
    if (modes == SSD).any() and (hw.nvme_write_bandwidth <= 0 or hw.nvme_read_bandwidth <= 0):
        raise ValueError("plans with SSD blocks need the NVMe bandwidths of the SSD path")
    serial = hw.copy_engines <= 0
    inline = serial and not hw.cpu_adam_thread     # CPU Adam on the compute timeline too
    shared = hw.copy_engines == 1
    gds = hw.nvme_gds
    ssd_w = zeros.copy()                      # the NVMe write queue (GDS)
    ssd_r = zeros.copy()                      # the NVMe read queue (GDS)
    w_time = (saved / min(hw.nvme_write_bandwidth, np.inf if gds else rr.d2h)
              if hw.nvme_write_bandwidth > 0 else saved * 0)
    r_time = (saved / min(hw.nvme_read_bandwidth, np.inf if gds else rr.h2d)
              if hw.nvme_read_bandwidth > 0 else saved * 0)
    def ev(lane, what, label, start, end, mask=True):
        if trace is not None and bool(np.asarray(mask).reshape(-1)[0]):
            a, b = float(np.asarray(start).reshape(-1)[0]), float(np.asarray(end).reshape(-1)[0])
            if b > a:
                trace.append((lane, what, label, a, b))

    def _check(c, which, d_end, cpu, comp):
        """An offloaded chunk's verdict check on the CPU queue as its gradients land."""
        if not t_host_check[c]:
            return cpu, comp
        end = np.maximum(cpu, d_end) + t_host_check[c]
        ev("cpu_adam", "check", f"chunk {c}", end - t_host_check[c], end, which)
        nonlocal_busy[0] += np.where(which, t_host_check[c], 0.0)
        if inline:
            comp = np.where(which, end, comp)
        return np.where(which, end, cpu), comp
    nonlocal_busy = [np.zeros(k_plans)]

    uploaded = 0
    up_start = np.zeros((n_chunks, k_plans))     # forward upload of each chunk starts at
    done_at = np.zeros((n_chunks, k_plans))      # CPU Adam of each offloaded chunk ends at
    for p, part in enumerate(parts):
        if p >= 2:
            comp = np.maximum(comp, swap_out_end[p - 2])
        for c, share in zip(layout.part_chunks[p] or (None,), layout.part_chunk_share[p]):
            if c is not None:
                while uploaded <= c:
                    j = uploaded
                    offl = j >= npers
                    src = j - nbuf
                    wait = np.where(offl & (src >= npers), released[np.maximum(src, 0), rows], 0.0)
                    up_start[j] = np.maximum(np.maximum(h2d, wait), comp if serial else 0.0)
                    end = up_start[j] + t_up[j]
                    ev("h2d", "upload", f"chunk {j}", up_start[j], end, offl)
                    h2d = np.where(offl, end, h2d)
                    ready[j] = np.where(offl, end, 0.0)
                    if shared:
                        d2h = h2d = np.maximum(h2d, d2h)
                    h2d_bytes += np.where(offl, layout.used[j] * profile.param_bytes / world, 0)
                    uploaded += 1
                comp = np.maximum(comp, ready[c])
            ev("compute", "fwd", part.name, comp, comp + part.fwd_time * share)
            comp = comp + part.fwd_time * share
        for c in last_of[p]:
            released[c] = comp
        if part.kind == "block":
            sw = modes[p] == SWAP
            end = np.maximum(d2h, comp) + saved[p] / rr.d2h
            ev("d2h", "swap_out", part.name, end - saved[p] / rr.d2h, end, sw)
            d2h = np.where(sw, end, d2h)
            swap_out_end[p] = np.where(sw, end, 0.0)
            d2h_bytes += np.where(sw, saved[p], 0)
            if serial:
                comp = np.where(sw, end, comp)
            if shared:
                d2h = h2d = np.maximum(h2d, d2h)
            sd = modes[p] == SSD
            if sd.any():
                queue = ssd_w if gds else d2h
                end = np.maximum(queue, comp) + w_time[p]
                ev("nvme", "nvme_write", part.name, end - w_time[p], end, sd)
                if gds:
                    ssd_w = np.where(sd, end, ssd_w)
                else:
                    d2h = np.where(sd, end, d2h)
                    d2h_bytes += np.where(sd, saved[p], 0)
                swap_out_end[p] = np.where(sd, end, swap_out_end[p])
    fwd_end = comp.copy()

    # ---------------- backward ----------------
    grad_out = np.full((n_chunks, k_plans), np.nan)  # gradient left the device at
    avail = np.zeros((n_chunks, k_plans))      # chunk resident for backward at
    swap_in_end = np.zeros((len(parts), k_plans))
    cpu = zeros.copy()
    cpu_busy = zeros.copy()
    # Updates left for after backward: (chunk, which plans, grads on host at, extra time: the
    # restore before a redo).
    deferred: list[tuple[int, np.ndarray, np.ndarray, np.ndarray | float]] = []
    next_chunk = n_chunks - 1                  # next chunk (descending) whose upload to issue
    for p in range(len(parts) - 1, -1, -1):
        part = parts[p]
        chunks = layout.part_chunks[p]
        # Re-uploads of the chunks this part needs first, highest index first. Chunks below
        # min_persist (tied parameters) are persistent in every plan: never re-uploaded.
        lowest = min((c for c in chunks if c >= layout.min_persist), default=next_chunk + 1)
        while next_chunk >= lowest:
            j = next_chunk
            offl = j >= npers
            reuse = j >= n_chunks - nbuf           # still in a buffer from forward
            need = offl & ~reuse
            src = np.minimum(j + nbuf, n_chunks - 1)
            end = np.maximum(np.maximum(h2d, np.where(need, grad_out[src, rows], 0.0)),
                             comp if serial else 0.0) + t_up[j]
            ev("h2d", "upload", f"chunk {j}", end - t_up[j], end, need)
            h2d = np.where(need, end, h2d)
            avail[j] = np.where(need, end, 0.0)
            if serial:
                comp = np.where(need, end, comp)
            if shared:
                d2h = h2d = np.maximum(h2d, d2h)
            h2d_bytes += np.where(need, layout.used[j] * profile.param_bytes / world, 0)
            next_chunk -= 1
        start = comp.copy()
        if serial and p >= 1 and parts[p - 1].kind == "block":
            # The previous block's swapped activations come back first, synchronously.
            comp = comp + np.where(modes[p - 1] == SWAP, saved[p - 1] / rr.h2d, 0.0)
        m = modes[p]
        comp = np.where((m == SWAP) | (m == SSD), np.maximum(comp, swap_in_end[p]), comp)
        redo = np.where(m == CKPT, part.fwd_time, np.where(m == SEL, part.sel_recompute_time, 0.0))
        rec = (m == CKPT) | (m == SEL)
        if chunks:
            all_ready = avail[list(chunks)].max(axis=0)
            ev("compute", "recompute", part.name, np.maximum(comp, all_ready),
               np.maximum(comp, all_ready) + redo, rec)
            comp = np.where(rec, np.maximum(comp, all_ready) + redo, comp)
            for c, share in zip(reversed(chunks), reversed(layout.part_chunk_share[p])):
                ev("compute", "bwd", part.name, np.maximum(comp, avail[c]),
                   np.maximum(comp, avail[c]) + part.bwd_time * share)
                comp = np.maximum(comp, avail[c]) + part.bwd_time * share
        else:
            ev("compute", "recompute", part.name, comp, comp + redo, rec)
            comp = np.where(rec, comp + redo, comp)
            ev("compute", "bwd", part.name, comp, comp + part.bwd_time)
            comp = comp + part.bwd_time
        # Prefetch the previous block's swapped activations, issued as this part starts.
        if p >= 1 and parts[p - 1].kind == "block":
            sw = modes[p - 1] == SWAP
            end = np.maximum(h2d, start) + saved[p - 1] / rr.h2d
            ev("h2d", "swap_in", parts[p - 1].name, end - saved[p - 1] / rr.h2d, end, sw)
            h2d = np.where(sw, end, h2d)
            swap_in_end[p - 1] = np.where(sw, end, 0.0)
            h2d_bytes += np.where(sw, saved[p - 1], 0)
            if shared:
                d2h = h2d = np.maximum(h2d, d2h)
            sd = modes[p - 1] == SSD
            if sd.any():
                queue = ssd_r if gds else h2d
                end = np.maximum(queue, start) + r_time[p - 1]
                ev("nvme", "nvme_read", parts[p - 1].name, end - r_time[p - 1], end, sd)
                if gds:
                    ssd_r = np.where(sd, end, ssd_r)
                else:
                    h2d = np.where(sd, end, h2d)
                    h2d_bytes += np.where(sd, saved[p - 1], 0)
                swap_in_end[p - 1] = np.where(sd, end, swap_in_end[p - 1])
        # Chunks whose gradient is now complete: offload and step on the CPU.
        for c in sorted(first_of[p], reverse=True):
            offl = c >= npers
            if serial and not checks_on_host and t_check[c]:     # the "device" checks, inline
                ev("compute", "check", f"chunk {c}", comp, comp + t_check[c], offl)
                comp = np.where(offl, comp + t_check[c], comp)
            d_end = np.maximum(d2h, comp) + t_down[c]
            ev("d2h", "offload", f"chunk {c}", d_end - t_down[c], d_end, offl)
            d2h = np.where(offl, d_end, d2h)
            grad_out[c] = np.where(offl, d_end, comp)
            d2h_bytes += np.where(offl, layout.used[c] * profile.param_bytes / world, 0)
            if serial:
                comp = np.where(offl, d_end, comp)
            if shared:
                d2h = h2d = np.maximum(h2d, d2h)
            if optimizer_step and cpu_overlap:
                c_end = np.maximum(cpu, d_end) + t_adam[c]
                ev("cpu_adam", "adam", f"chunk {c}", c_end - t_adam[c], c_end, offl)
                cpu = np.where(offl, c_end, cpu)
                done_at[c] = c_end
                cpu_busy += np.where(offl, t_adam[c], 0.0)
                if inline:                   # between two parts' compute
                    comp = np.where(offl, c_end, comp)
            elif optimizer_step and spec_from is not None:
                spec = offl & (c >= spec_from)
                c_end = np.maximum(cpu, d_end) + t_spec[c]
                ev("cpu_adam", "backup_adam", f"chunk {c}", c_end - t_spec[c], c_end, spec)
                cpu = np.where(spec, c_end, cpu)
                done_at[c] = c_end
                cpu_busy += np.where(spec, t_spec[c], 0.0)
                spec_ready[c] = np.where(spec, c_end - t_adam[c], np.inf)
                if inline:
                    comp = np.where(spec, c_end, comp)
                if speculation_wrong:
                    deferred.append((c, offl, d_end, np.where(spec, t_backup[c], 0.0)))
                else:
                    deferred.append((c, offl & ~spec, d_end, 0.0))
                cpu, comp = _check(c, offl & ~spec, d_end, cpu, comp)
            elif optimizer_step:
                deferred.append((c, offl, d_end, 0.0))
                cpu, comp = _check(c, offl, d_end, cpu, comp)
    bwd_end = comp
    if np.isnan(bwd_end).any():
        # A buffer was reused before its chunk was done with: n_buffer is below
        # layout.min_buffers(n_persist), which callers must not ask for.
        raise ValueError("n_buffer too small for this chunk layout (see ChunkLayout.min_buffers)")

    cpu_busy += nonlocal_busy[0]
    tail = np.maximum(cpu, bwd_end)
    for c, offl, d_end, extra in deferred:
        c_end = np.maximum(np.maximum(cpu, d_end), bwd_end) + t_adam[c] + extra
        cpu = np.where(offl, c_end, cpu)
        cpu_busy += np.where(offl, t_adam[c] + extra, 0.0)
    # The runtime runs what step() leaves in chunk order (the next forward's upload order).
    for c, offl, d_end, extra in sorted(deferred, key=lambda d: d[0]):
        start = np.maximum(tail, d_end)
        ev("cpu_adam", "rollback", f"chunk {c}", start, start + extra, offl & (np.asarray(extra) > 0))
        tail = np.where(offl, start + extra + t_adam[c], tail)
        done_at[c] = np.where(offl, tail, done_at[c])
        ev("cpu_adam", "redo" if speculation_wrong and c >= np.asarray(spec_from).reshape(-1)[0] else "adam",
           f"chunk {c}", tail - t_adam[c], tail, offl)
    prefix = np.concatenate([[0], np.cumsum(layout.used)])
    # Device tail at the boundary: all-reduce of the persistent gradients, then device Adam.
    gpu_optim = (prefix[npers] / rr.device_adam + persistent_allreduce_time(layout, npers, hw, world)
                 if optimizer_step else np.zeros(k_plans))
    if inline:                        # one timeline: CPU Adam, then the "device" Adam
        device_end = np.maximum(bwd_end, cpu) + gpu_optim
    else:
        device_end = bwd_end + gpu_optim
    ev("compute", "device_adam", "persistent chunks", device_end - gpu_optim, device_end)
    iter_time = np.maximum(device_end, cpu)
    # Exposed: CPU Adam past the device's own work. On one timeline (a CPU "device") that is
    # the updates left for after backward (the inline ones count as backward's time).
    exposed = np.maximum(cpu - (bwd_end if inline else device_end), 0.0)
    if carry_over and optimizer_step and not inline and n_chunks:
        offl_rows = np.arange(n_chunks)[:, None] >= npers[None, :]
        late = np.where(offl_rows, done_at - device_end[None, :] - up_start, -np.inf).max(axis=0)
        carried = np.maximum(device_end + np.maximum(late, 0.0), cpu_busy)
        iter_time = np.minimum(iter_time, carried)
        exposed = np.maximum(iter_time - device_end, 0.0)
    return TimePrediction(
        iter_time=iter_time, fwd_time=fwd_end, bwd_time=bwd_end - fwd_end,
        gpu_optim_time=gpu_optim, cpu_optim_time=cpu_busy,
        cpu_optim_exposed=exposed,
        h2d_bytes=h2d_bytes, d2h_bytes=d2h_bytes,
        spec_useful=(spec_ready < bwd_end[None, :]).sum(axis=0) if spec_from is not None else None)
