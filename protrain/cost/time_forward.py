"""The forward phase of the step-time model (``cost.time_model``): parts in order (pre, blocks,
post), each part's compute split over the chunks it uses.

- A non-persistent chunk is uploaded (H2D) into a buffer as early as both the copy engine and a
  free buffer allow: chunk c reuses the buffer of chunk c - n_buffer, free once the last part
  using that chunk has finished; compute on a chunk waits for its upload. With enough buffers
  this is the per-chunk max(compute, transfer) of the paper; with too few, the wait shows.
- A SWAP block's saved activations go D2H after its forward; at most one swapped block may be
  in flight, so part k+1 cannot start before the swap-out of part k-1 is done. An SSD block's
  are written to NVMe: on a queue of their own with GPUDirect Storage, else through the host
  on the D2H queue.
"""
from __future__ import annotations

import numpy as np

from ..block_mode import CKPT_HOST, CKPT_SSD, SSD, SWAP
from .time_queues import QueueState, StepCosts, select


def simulate_forward(costs: StepCosts, q: QueueState) -> np.ndarray:
    """Advance ``q`` through forward; returns its end (compute of the post part) per plan."""
    layout, parts = costs.layout, costs.profile.parts
    ready = np.zeros((layout.n_chunks, costs.k_plans))             # chunk resident (upload done) at
    released = np.full((layout.n_chunks, costs.k_plans), np.nan)   # buffer of chunk free at
    swap_out_end = np.zeros((len(parts), costs.k_plans))
    last_of: list[list[int]] = [[] for _ in parts]                 # chunks whose last user is part p
    for c in range(layout.n_chunks):
        last_of[layout.chunk_last_part[c]].append(c)
    uploaded = 0
    for p, part in enumerate(parts):
        if p >= 2:
            q.comp = np.maximum(q.comp, swap_out_end[p - 2])
        for c, share in zip(layout.part_chunks[p] or (None,), layout.part_chunk_share[p]):
            if c is not None:
                while uploaded <= c:
                    _upload(costs, q, uploaded, released, ready)
                    uploaded += 1
                q.comp = np.maximum(q.comp, ready[c])
            if q.trace is not None:
                q.record("compute", "fwd", part.name, q.comp, q.comp + part.fwd_time * share)
            q.comp = q.comp + part.fwd_time * share
        for c in last_of[p]:
            released[c] = q.comp
        if part.kind == "block":
            _write_out_activations(costs, q, p, swap_out_end)
    return q.comp.copy()


def _upload(costs: StepCosts, q: QueueState, j: int, released: np.ndarray, ready: np.ndarray) -> None:
    """Chunk j's upload, where it is offloaded: after the uploads before it and once the chunk
    n_buffer below it has released the buffer (on a serial device, also after the compute
    issued so far)."""
    offl, u = costs.streamed(j), costs.streams_in(j)
    reuse = costs.reuses_in(j)
    if reuse is None:
        src = j - costs.nbuf
        wait = np.where(offl & (src >= costs.nrep), costs.at_chunk(released, np.maximum(src, 0)), 0.0)
    else:
        wait = costs.at_chunk(released, j - costs.nbuf) if reuse else 0.0
    q.up_start[j] = np.maximum(np.maximum(q.h2d, wait), q.comp if costs.serial else 0.0)
    end = q.up_start[j] + costs.up_time(j)
    if q.trace is not None:
        q.record("h2d", "upload", f"chunk {j}", q.up_start[j], end, offl)
    q.h2d = select(u, offl, end, q.h2d)
    ready[j] = select(u, offl, end, 0.0)
    if costs.shared:
        q.join_copy_queues()
    q.h2d_bytes += select(costs.host_in(j), j >= costs.npers, costs.chunk_bytes(j), 0)


def _write_out_activations(costs: StepCosts, q: QueueState, p: int, swap_out_end: np.ndarray) -> None:
    """Block p's saved activations leave the device after its forward: D2H where it swaps, to
    NVMe where it is an SSD block (its input where it is a CKPT_HOST / CKPT_SSD block)."""
    part, saved, modes = costs.profile.parts[p], costs.saved, costs.modes
    sw = (modes[p] == SWAP) | (modes[p] == CKPT_HOST)
    end = np.maximum(q.d2h, q.comp) + saved[p] / costs.rr.d2h
    if q.trace is not None:
        q.record("d2h", "swap_out", part.name, end - saved[p] / costs.rr.d2h, end, sw)
    q.d2h = np.where(sw, end, q.d2h)
    swap_out_end[p] = np.where(sw, end, 0.0)
    q.d2h_bytes += np.where(sw, saved[p], 0)
    if costs.serial:
        q.comp = np.where(sw, end, q.comp)
    if costs.shared:
        q.join_copy_queues()
    sd = (modes[p] == SSD) | (modes[p] == CKPT_SSD)
    if sd.any():
        queue = q.ssd_w if costs.gds else q.d2h
        end = np.maximum(queue, q.comp) + costs.w_time[p]
        if q.trace is not None:
            q.record("nvme", "nvme_write", part.name, end - costs.w_time[p], end, sd)
        q.drive_busy[1] += np.where(sd, costs.w_time[p], 0.0)
        if costs.gds:
            q.ssd_w = np.where(sd, end, q.ssd_w)
        else:
            q.d2h = np.where(sd, end, q.d2h)
            q.d2h_bytes += np.where(sd, saved[p], 0)
        swap_out_end[p] = np.where(sd, end, swap_out_end[p])
