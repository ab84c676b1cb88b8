"""The backward phase of the step-time model (``cost.time_model``): parts in reverse, chunks in
reverse, and the gradients' way to CPU Adam.

- The last n_buffer non-persistent chunks are still in their buffers and are reused; the others
  are uploaded again, chunk c into the buffer of chunk c + n_buffer once that chunk's gradient
  has left the device.
- A SWAP block's activations are prefetched (H2D) when the next part's backward starts; they
  share the copy engine with chunk uploads, in issue order - this is how swapping competes with
  parameter prefetch for PCIe. SSD blocks are read back alike, from NVMe.
- A CKPT block first recomputes its forward (all its chunks resident), then runs backward; a
  SELECTIVE block recomputes its forward without attention and all-to-alls
  (PartProfile.sel_recompute_time). A CKPT_HOST block's input is prefetched as a SWAP block's
  activations are (a CKPT_SSD block's from NVMe, as an SSD block's), then the block recomputes
  as a CKPT block.
- When the first part using a chunk has finished backward, the chunk's gradient is complete:
  a persistent chunk's all-reduce over the ranks starts (the collectives' queue), non-persistent
  chunks go D2H, then to CPU Adam (one chunk at a time), overlapping backward -
  or, where the step needs every gradient first (clipping, fp16), their updates wait for the
  step's end (``cost.time_step_end``), except the speculating chunks', which back up their
  states and update now.
"""
from __future__ import annotations

import numpy as np

from ..block_mode import CKPT, CKPT_HOST, CKPT_SSD, SEL, SSD, SWAP
from .time_queues import QueueState, StepCosts, select
from .time_state_io import at_rows, nvme_turn, staged_update, staged_update_masked


def simulate_backward(costs: StepCosts, q: QueueState) -> np.ndarray:
    """Advance ``q`` through backward; returns its end (backward's compute) per plan."""
    layout, parts = costs.layout, costs.profile.parts
    grad_out = np.full((layout.n_chunks, costs.k_plans), np.nan)   # gradient left the device at
    avail = np.zeros((layout.n_chunks, costs.k_plans))             # chunk resident for backward at
    swap_in_end = np.zeros((len(parts), costs.k_plans))
    first_of: list[list[int]] = [[] for _ in parts]                # chunks whose first user is part p
    for c in range(layout.n_chunks):
        first_of[layout.chunk_first_part[c]].append(c)
    next_chunk = layout.n_chunks - 1           # next chunk (descending) whose upload to issue
    for p in range(len(parts) - 1, -1, -1):
        # Re-uploads of the chunks this part needs first, highest index first. Chunks below
        # min_persist (tied parameters) are persistent in every plan: never re-uploaded.
        lowest = min((c for c in layout.part_chunks[p] if c >= layout.min_persist),
                     default=next_chunk + 1)
        while next_chunk >= lowest:
            _reupload(costs, q, next_chunk, grad_out, avail)
            next_chunk -= 1
        start = q.comp.copy()
        _part_backward(costs, q, p, avail, swap_in_end)
        if p >= 1 and parts[p - 1].kind == "block":
            _prefetch_activations(costs, q, p - 1, start, swap_in_end)
        for c in sorted(first_of[p], reverse=True):
            _offload_gradient(costs, q, c, grad_out)
    if np.isnan(q.comp).any():
        # A buffer was reused before its chunk was done with: n_buffer is below
        # layout.min_buffers(n_persist), which callers must not ask for.
        raise ValueError("n_buffer too small for this chunk layout (see ChunkLayout.min_buffers)")
    if costs.cpu_overlap and costs.optimizer_step and not costs.inline:
        serve_pending(costs, q, np.inf)        # what is left: lowest chunk first
    q.cpu_busy += q.check_busy
    return q.comp


def _reupload(costs: StepCosts, q: QueueState, j: int, grad_out: np.ndarray, avail: np.ndarray) -> None:
    """Chunk j's upload for backward, where it is offloaded and no longer in a buffer: once the
    chunk n_buffer above it has sent its gradient off."""
    n_chunks = costs.layout.n_chunks
    u = costs.refetched_in(j)
    if u is False:                              # in no plan: nothing issued
        avail[j] = 0.0
        if costs.shared:
            q.join_copy_queues()
        return
    need = costs.streamed(j) & (j < n_chunks - costs.nbuf) if u is None else True
    src = np.minimum(j + costs.nbuf, n_chunks - 1)
    t_up = costs.up_time(j)
    end = np.maximum(np.maximum(q.h2d, select(u, need, costs.at_chunk(grad_out, src), 0.0)),
                     q.comp if costs.serial else 0.0) + t_up
    if q.trace is not None:
        q.record("h2d", "upload", f"chunk {j}", end - t_up, end, need)
    q.h2d = select(u, need, end, q.h2d)
    avail[j] = select(u, need, end, 0.0)
    if costs.serial:
        q.comp = select(u, need, end, q.comp)
    if costs.shared:
        q.join_copy_queues()
    q.h2d_bytes += select(costs.host_in(j) if u else None, need & (j >= costs.npers), costs.chunk_bytes(j), 0)


def _part_backward(costs: StepCosts, q: QueueState, p: int, avail: np.ndarray,
                   swap_in_end: np.ndarray) -> None:
    """Part p's compute: its activations back, its recompute, then its backward chunk by chunk,
    each chunk's share once the chunk is resident."""
    parts, modes = costs.profile.parts, costs.modes
    part, chunks = parts[p], costs.layout.part_chunks[p]
    if costs.serial and p >= 1 and parts[p - 1].kind == "block":
        # The previous block's swapped activations come back first, synchronously.
        q.comp = q.comp + np.where((modes[p - 1] == SWAP) | (modes[p - 1] == CKPT_HOST),
                                   costs.saved[p - 1] / costs.rr.h2d, 0.0)
    m = modes[p]
    q.comp = np.where((m == SWAP) | (m == SSD) | (m == CKPT_HOST) | (m == CKPT_SSD),
                      np.maximum(q.comp, swap_in_end[p]), q.comp)
    full = (m == CKPT) | (m == CKPT_HOST) | (m == CKPT_SSD)
    redo = np.where(full, part.fwd_time, np.where(m == SEL, part.sel_recompute_time, 0.0))
    rec = full | (m == SEL)
    if chunks:
        all_ready = avail[list(chunks)].max(axis=0)
        if q.trace is not None:
            q.record("compute", "recompute", part.name, np.maximum(q.comp, all_ready),
                     np.maximum(q.comp, all_ready) + redo, rec)
        q.comp = np.where(rec, np.maximum(q.comp, all_ready) + redo, q.comp)
        for c, share in zip(reversed(chunks), reversed(costs.layout.part_chunk_share[p])):
            if q.trace is not None:
                q.record("compute", "bwd", part.name, np.maximum(q.comp, avail[c]),
                         np.maximum(q.comp, avail[c]) + part.bwd_time * share)
            q.comp = np.maximum(q.comp, avail[c]) + part.bwd_time * share
    else:
        if q.trace is not None:
            q.record("compute", "recompute", part.name, q.comp, q.comp + redo, rec)
        q.comp = np.where(rec, q.comp + redo, q.comp)
        if q.trace is not None:
            q.record("compute", "bwd", part.name, q.comp, q.comp + part.bwd_time)
        q.comp = q.comp + part.bwd_time


def _prefetch_activations(costs: StepCosts, q: QueueState, b: int, start: np.ndarray,
                          swap_in_end: np.ndarray) -> None:
    """Block b's offloaded activations come back, issued as the part after it starts its
    backward (``start``): H2D where it swapped (its input where it is a CKPT_HOST block), from
    NVMe where it is an SSD block."""
    name, saved, modes = costs.profile.parts[b].name, costs.saved, costs.modes
    sw = (modes[b] == SWAP) | (modes[b] == CKPT_HOST)
    end = np.maximum(q.h2d, start) + saved[b] / costs.rr.h2d
    if q.trace is not None:
        q.record("h2d", "swap_in", name, end - saved[b] / costs.rr.h2d, end, sw)
    q.h2d = np.where(sw, end, q.h2d)
    swap_in_end[b] = np.where(sw, end, 0.0)
    q.h2d_bytes += np.where(sw, saved[b], 0)
    if costs.shared:
        q.join_copy_queues()
    sd = (modes[b] == SSD) | (modes[b] == CKPT_SSD)
    if sd.any():
        queue = q.ssd_r if costs.gds else q.h2d
        end = np.maximum(queue, start) + costs.r_time[b]
        if q.trace is not None:
            q.record("nvme", "nvme_read", name, end - costs.r_time[b], end, sd)
        q.drive_busy[0] += np.where(sd, costs.r_time[b], 0.0)
        if costs.gds:
            q.ssd_r = np.where(sd, end, q.ssd_r)
        else:
            q.h2d = np.where(sd, end, q.h2d)
            q.h2d_bytes += np.where(sd, saved[b], 0)
        swap_in_end[b] = np.where(sd, end, swap_in_end[b])


def _offload_gradient(costs: StepCosts, q: QueueState, c: int, grad_out: np.ndarray) -> None:
    """Chunk c's gradient is complete: where the chunk is offloaded, it goes D2H (checked
    first on a serial device whose checks are its own), then on to the CPU optimizer. A sharded
    chunk's gradients are reduce-scattered into its shard on the device, on the same queue, and
    wait there for device Adam."""
    offl, u = costs.streamed(c), costs.streams_in(c)
    if costs.optimizer_step and costs.t_allreduce[c]:
        # A persistent chunk's all-reduce starts as its backward ends, on the collectives'
        # queue (the runtime's persistent_backward_done); the step's end waits for what is left.
        start = np.maximum(q.net, q.comp)
        end = start + costs.t_allreduce[c]
        if q.trace is not None:
            q.record("collective", "all_reduce", f"chunk {c}", start, end, ~offl)
        q.net = select(u, offl, q.net, end)
    host, h = c >= costs.npers, costs.host_in(c)   # its states on the host: CPU Adam's
    if costs.serial and not costs.checks_on_host and costs.t_check[c]:   # the "device" checks, inline
        if q.trace is not None:
            q.record("compute", "check", f"chunk {c}", q.comp, q.comp + costs.t_check[c], host)
        q.comp = select(h, host, q.comp + costs.t_check[c], q.comp)
    t_down = costs.down_time(c)
    d_end = np.maximum(q.d2h, q.comp) + t_down
    if q.trace is not None:
        q.record("d2h", "offload", f"chunk {c}", d_end - t_down, d_end, offl)
    q.d2h = select(u, offl, d_end, q.d2h)
    grad_out[c] = select(u, offl, d_end, q.comp)
    q.d2h_bytes += select(h, host, costs.chunk_bytes(c), 0)
    if costs.any_shard:
        q.shard_down = np.where(offl & ~host, d_end, q.shard_down)
    if costs.serial:
        q.comp = select(u, offl, d_end, q.comp)
    if costs.shared:
        q.join_copy_queues()
    offl = host                               # the CPU optimizer's part, below
    if not costs.optimizer_step:
        return
    if costs.cpu_overlap and costs.inline:
        _update_now(costs, q, c, offl, d_end, costs.t_adam[c], "adam")
    elif costs.cpu_overlap:
        serve_pending(costs, q, d_end)
        drive = offl & costs.on_drive(c)
        push_drive(q, c, drive, d_end, d_end)       # its read wanted as its gradients land
        push_pending(q, c, offl & ~drive, d_end)
    elif costs.spec_from is not None:
        spec = offl & (c >= costs.spec_from)
        # States on the drive need no backup: the speculative ones go to the other slot.
        drive = costs.on_drive(c)
        _update_now(costs, q, c, spec, d_end,
                    np.where(drive, costs.t_host_check[c] + costs.t_adam[c], costs.t_spec[c]), "backup_adam")
        q.spec_ready[c] = np.where(spec, q.done_at[c] - costs.t_adam[c], np.inf)
        if costs.speculation_wrong:
            q.deferred.append((c, offl, d_end, np.where(spec & ~drive, costs.t_backup[c], 0.0)))
        else:
            q.deferred.append((c, offl & ~spec, d_end, 0.0))
        _host_check(costs, q, c, offl & ~spec, d_end)
    else:
        q.deferred.append((c, offl, d_end, 0.0))
        _host_check(costs, q, c, offl, d_end)


def _update_now(costs: StepCosts, q: QueueState, c: int, which: np.ndarray, d_end: np.ndarray,
                t_turn, what: str) -> None:
    """Chunk c's update on the CPU queue during backward, once its gradient is on the host
    (and its states, where they are on the drive: ``cost.time_state_io``); ``t_turn``: its
    time there (the update, or the speculation's check, backup and update)."""
    c_end, turn = staged_update_masked(costs, q, c, which, d_end, q.cpu, d_end, t_turn)
    if q.trace is not None:
        q.record("cpu_adam", what, f"chunk {c}", c_end - turn, c_end, which)
    q.cpu = np.where(which, c_end, q.cpu)
    q.done_at[c] = c_end
    q.cpu_busy += np.where(which, turn, 0.0)
    if costs.inline:                   # between two parts' compute
        q.comp = np.where(which, c_end, q.comp)


def push_pending(q: QueueState, c: int, which: np.ndarray, d_end: np.ndarray, extra=0.0) -> None:
    """Chunk c's exact update waits for the CPU (plans ``which``), its gradients on the host
    at ``d_end``; ``extra``: seconds before it on the CPU queue (a restore)."""
    rows = np.flatnonzero(which)
    if not len(rows):
        return
    q.grads_at[c, rows] = at_rows(d_end, rows)
    if np.any(extra):
        q.extra[c, rows] = at_rows(extra, rows)
    q.pending[q.n_pending[rows], rows] = c
    q.n_pending[rows] += 1


def push_drive(q: QueueState, c: int, which: np.ndarray, d_end, want, extra=0.0) -> None:
    """Chunk c, its states on the drive, joins the pending updates (plans ``which``) behind
    those of the drive before it, its states' read wanted at ``want``."""
    rows = np.flatnonzero(which)
    if not len(rows):
        return
    q.grads_at[c, rows] = at_rows(d_end, rows)
    q.extra[c, rows] = at_rows(extra, rows)
    q.want_at[c, rows] = at_rows(want, rows)
    q.nvq[q.nv_tail[rows], rows] = c
    q.nv_tail[rows] += 1


def serve_pending(costs: StepCosts, q: QueueState, until, label=None) -> None:
    """The CPU takes pending updates, each whenever it is free before ``until`` (the next
    gradient's landing; inf: all of them): of those in host memory the lowest chunk first
    (the runtime's worker does: the next forward needs the lowest offloaded chunk first;
    gradients land in descending chunk order, so during backward that is the one that landed
    last, and what backward leaves runs in the next forward's upload order), interleaved in
    proportion with those on the drive, in their FIFO's order (``time_state_io.nvme_turn``:
    the drive reads the next one's states while the CPU updates the others). ``label(j)``:
    what the trace calls an update of chunk j (default "adam")."""
    until = np.broadcast_to(until, q.cpu.shape)
    if not costs.any_nvme:
        _serve_in_host(costs, q, until, label)
        return
    while True:
        has_h = q.n_pending > 0
        has_d = q.nv_head < q.nv_tail
        rows = np.flatnonzero((has_h | has_d) & (q.cpu <= until))
        if not len(rows):
            return
        pick = nvme_turn(q.taken[:, rows], q.totals[:, rows], has_d[rows], has_h[rows])
        hr, dr = rows[~pick], rows[pick]
        if len(hr):
            q.n_pending[hr] -= 1
            j = q.pending[q.n_pending[hr], hr]
            free = np.maximum(q.cpu[hr], q.grads_at[j, hr]) + q.extra[j, hr]
            _served(costs, q, hr, j, free, free + costs.t_adam[j], 1, label)
        if len(dr):
            j = q.nvq[q.nv_head[dr], dr]
            q.nv_head[dr] += 1
            free = np.maximum(q.cpu[dr], q.grads_at[j, dr]) + q.extra[j, dr]
            start, end = staged_update(costs, q, dr, j, q.want_at[j, dr], free, q.grads_at[j, dr],
                                       costs.t_adam[j])
            _served(costs, q, dr, j, start, end, 0, label)


def _serve_in_host(costs: StepCosts, q: QueueState, until, label) -> None:
    """``serve_pending`` where no plan keeps states on the drive (and nothing waits before an
    update: during backward): lowest chunk first."""
    while True:
        rows = np.flatnonzero((q.n_pending > 0) & (q.cpu <= until))
        if not len(rows):
            return
        q.n_pending[rows] -= 1
        j = q.pending[q.n_pending[rows], rows]
        turn = costs.t_adam[j]
        start = np.maximum(q.cpu[rows], q.grads_at[j, rows])
        q.cpu[rows] = start + turn
        q.done_at[j, rows] = start + turn
        q.cpu_busy[rows] += turn
        if q.trace is not None and rows[0] == 0:
            q.record("cpu_adam", label(int(j[0])) if label else "adam", f"chunk {j[0]}", start[0], start[0] + turn[0])


def _served(costs: StepCosts, q: QueueState, rows, j, start, end, kind: int, label) -> None:
    """Book the updates of chunks ``j`` (one per plan of ``rows``) that ran [start, end)."""
    extra = q.extra[j, rows]
    q.cpu[rows] = end
    q.done_at[j, rows] = end
    q.cpu_busy[rows] += costs.t_adam[j] + extra
    q.taken[kind, rows] += 1
    if q.trace is not None and rows[0] == 0:
        if extra[0] > 0:
            q.record("cpu_adam", "rollback", f"chunk {j[0]}", start[0] - extra[0], start[0])
        q.record("cpu_adam", label(int(j[0])) if label else "adam", f"chunk {j[0]}",
                 end[0] - costs.t_adam[j[0]], end[0])


def _host_check(costs: StepCosts, q: QueueState, c: int, which: np.ndarray, d_end: np.ndarray) -> None:
    """An offloaded chunk's verdict check on the CPU queue as its gradients land."""
    if not costs.t_host_check[c]:
        return
    end = np.maximum(q.cpu, d_end) + costs.t_host_check[c]
    if q.trace is not None:
        q.record("cpu_adam", "check", f"chunk {c}", end - costs.t_host_check[c], end, which)
    q.check_busy += np.where(which, costs.t_host_check[c], 0.0)
    if costs.inline:
        q.comp = np.where(which, end, q.comp)
    q.cpu = np.where(which, end, q.cpu)
