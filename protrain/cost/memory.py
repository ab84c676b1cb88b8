"""Memory cost model: peak device bytes and host bytes of a plan. Pure functions.

Peak device memory = model states (constant all iteration: persistent chunks and pre-allocated
buffers) + the highest point of an execution-order walk over activations. The walk starts from
the keep-all profile and subtracts what the block modes free:

    X_k = sum over blocks j < k of freed_j,
    freed = {NONE: 0, CKPT: own - held, SELECTIVE: own - held - attn, SWAP/SSD: own',
             CKPT_HOST/CKPT_SSD: own}
    own  = saved - kept   (a block's saved storages but those a later part saves too)
    own' = own, or saved when the next block offloads the kept storages as well
    held = in - in_shared (the input CKPT holds, unless an earlier part keeps it live anyway)
    attn = sel_saved - in (the attention outputs the selective mode keeps)

- forward of part k:   fwd_peak_k - X_k  (+ flight_{k-1} while the previous block's swap-out
  is still in flight; the runtime allows one block in flight);
- backward of NONE/SWAP part k:  bwd_peak_k - X_k  (+ flight_{k-1} while the next swapped block
  is prefetched, one block ahead; storages still on the device are handed back as is);
      flight = own' + resaved if the block before offloaded them too (each offloaded block
      copies what it saved, re-saved storages included, and brings back its own copies), and
      + resaved_k when k and k-1 are both offloaded (both copies are back at k's backward);
- backward of a CKPT part k: max(recompute bump, backward):
      recompute = bwd_start_k - X_k - (saved_k - held_k) + (fwd_peak_k - fwd_start_k)
      backward  = bwd_peak_k - X_k
  (by its own backward the later parts are done: every saved storage but the input is gone);
  the checkpoint-input chain is in X_k: every earlier CKPT block still holds its input.
- a SELECTIVE part the same: its recompute rebuilds everything but what it kept, so it ends
  at the keep-all level too (the kept attention outputs are not allocated again); the same
  bound holds.
- a CKPT_HOST / CKPT_SSD part as a CKPT part, its input back on the device by then; its
  input's copy is in flight as an offloaded block's (held bytes: during the next part's forward, and while
  it is fetched back during the next part's backward).

The profile's peaks come from the device allocator on CUDA, so intra-op transients (workspaces)
and inter-op deltas (allocations outside hooked ops) are already inside fwd_peak / bwd_peak.
One transient of the runtime's own is not in the profile and is added to the peak: the fp32
copy a clipping norm takes of a 16-bit gradient on the device (``norm_scratch_bytes``).
A fragmentation margin is applied by the caller when checking feasibility.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..block_mode import ACTIVATION_FILE_HEADROOM, ACTIVATION_FILE_SLACK, CKPT, CKPT_HOST, CKPT_SSD, INPUT_MOVED, NONE, SEL, SSD, SWAP, BlockMode
from ..profile.model_profile import ModelProfile
from ..layout import ChunkLayout
from ..state_tier import (STAGING_SLOTS, staged_bytes_per_element, staging_ring_bytes, state_bytes_per_element,
                          state_file_bytes)


# ---- model states ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StateBytes:
    """Bytes per parameter element of the model states, where they live (what the chunk
    runtime allocates; see protrain.runtime.chunks)."""

    persistent: int
    """Device bytes per element of a persistent chunk: the parameter in the training dtype,
    its gradient in fp32 (the device Adam consumes fp32 gradients, and micro-batches
    accumulate in fp32 as DeepSpeed does), the fp32 master copy when training in 16 bits,
    and Adam's m and v in fp32. 18 bytes in bf16/fp16, 16 in fp32."""
    buffer: int
    """Device bytes per element of a chunk buffer: the parameters in the training dtype; once a
    chunk's backward is done its gradients overwrite them in place (the master is on the host)."""
    host: int
    """Pinned host bytes per element of an offloaded chunk: fp32 master, Adam m and v (12),
    plus, in 16-bit training, the parameters in the training dtype (the upload source).
    Without gradient accumulation the gradients land in that same region: a chunk's backward
    upload always precedes its gradients, and CPU Adam consumes them slice by slice and writes
    the updated parameters back in their place (14 bytes in bf16; fp32 needs its own 4-byte
    landing region, since its master is the upload source: 16). With accumulation the
    gradients need an fp32 accumulator of their own (18 in bf16, 16 in fp32)."""
    nvme: int = 12
    """Of ``host``, the bytes per element an NVMe chunk keeps on the drive instead
    (``state_tier.state_bytes_per_element``: the fp32 master where separate, Adam's m and v;
    12 in bf16/fp16, 8 in fp32): what its update reads. Its parameters and gradients stay on
    the host."""
    nvme_staged: int = 12
    """Bytes per element of a staging buffer, a place on the drive and a write-back
    (``state_tier.staged_bytes_per_element``: ``nvme``, and 4 more in fp32 with speculation)."""


def state_bytes(param_bytes: int, grad_accumulation: bool = False, speculative: bool = False) -> StateBytes:
    """``speculative``: CPU Adam may update chunks before the step's verdict."""
    half = param_bytes < 4
    host = 12 + (param_bytes if half else 0) + (4 if grad_accumulation or not half else 0)
    return StateBytes(persistent=param_bytes + 4 + (4 if half else 0) + 8,
                      buffer=param_bytes, host=host, nvme=state_bytes_per_element(half),
                      nvme_staged=staged_bytes_per_element(half, speculative))


def model_state_device_bytes(layout: ChunkLayout, n_persist, n_buffer, sb: StateBytes,
                             world: int = 1, n_shard=0):
    """Persistent chunks (exact size, replicated on every rank; the last ``n_shard`` of them
    sharded: ``sharded_state_bytes``) + n_buffer buffers of one chunk capacity each."""
    prefix = np.concatenate([[0], np.cumsum(layout.used, dtype=np.int64)])
    n_persist = np.asarray(n_persist)
    rep = n_persist - np.asarray(n_shard)
    sharded = sharded_state_bytes(layout, sb, world)
    return (prefix[rep] * sb.persistent + sharded[n_persist] - sharded[rep]
            + np.asarray(n_buffer, dtype=np.int64) * buffer_numel(layout, world) * sb.buffer)


def sharded_state_bytes(layout: ChunkLayout, sb: StateBytes, world: int) -> np.ndarray:
    """[n_chunks + 1] device bytes of the first k chunks kept sharded (at index k): each rank's
    1/world shard holds what an offloaded chunk's shard holds on the host (``sb.host`` per
    element: the parameters, fp32 master, Adam's m and v, the gradients' landing or
    accumulator), on the device."""
    shard = -(-np.asarray(layout.used, dtype=np.int64) // world)
    return np.concatenate([[0], np.cumsum(shard)]) * sb.host


def buffer_numel(layout: ChunkLayout, world: int) -> int:
    """Elements of one device buffer: the chunk capacity padded to a multiple of the world
    size, so a chunk splits into equal shards for all-gather / reduce-scatter."""
    return -(-layout.chunk_numel // world) * world


def model_state_host_bytes(layout: ChunkLayout, n_persist, sb: StateBytes, world: int = 1, n_nvme=0):
    """Exact-size pinned host memory for the non-persistent chunks' states, per rank: with
    ``world`` data-parallel ranks each keeps a 1/world shard of every offloaded chunk. The
    last ``n_nvme`` chunks keep their optimizer states on the drive: the host keeps their
    parameters and gradients, and the staging ring CPU Adam streams the states through."""
    shard = np.concatenate([[0], np.cumsum([-(-u // world) for u in layout.used], dtype=np.int64)])
    return ((shard[-1] - shard[np.asarray(n_persist)]) * sb.host
            - nvme_state_top(layout, sb, world)[np.asarray(n_nvme)] + staging_bytes(layout, sb, world, n_nvme))


def nvme_state_top(layout: ChunkLayout, sb: StateBytes, world: int = 1, staged: bool = False) -> np.ndarray:
    """At index k (0 .. n_chunks): bytes of optimizer states of the last k chunks' shards - what
    k NVMe chunks take off the host, and read from the drive each step; ``staged``: what they
    write back (``StateBytes.nvme_staged``)."""
    shard = -(-np.asarray(layout.used, dtype=np.int64) // world) * (sb.nvme_staged if staged else sb.nvme)
    return np.concatenate([[0], np.cumsum(shard[::-1])])


def staging_bytes(layout: ChunkLayout, sb: StateBytes, world: int, n_nvme):
    """Pinned host bytes of the staging ring (``state_tier.staging_ring_bytes``:
    ``STAGING_SLOTS`` buffers of one chunk capacity's shard of states, 4 KiB-aligned) where any
    chunk's states are on the drive. The runtime sizes its buffers by the largest NVMe chunk,
    at most the capacity: this is its bound, exact where that chunk is full."""
    ring = staging_ring_bytes(-(-layout.chunk_numel // world), sb.nvme_staged // 4)
    return np.where(np.asarray(n_nvme) > 0, ring, 0)


def nvme_file_top(layout: ChunkLayout, sb: StateBytes, world: int = 1) -> np.ndarray:
    """At index k (0 .. n_chunks): bytes of the state file of the last k chunks on one rank, as
    the runtime lays it out (``state_tier.state_file_bytes``: both places of every chunk, each
    field padded to the largest of those chunks' shards and 4 KiB-aligned)."""
    shard = -(-np.asarray(layout.used, dtype=np.int64) // world)
    largest = np.concatenate([[0], np.maximum.accumulate(shard[::-1])])
    return state_file_bytes(np.arange(layout.n_chunks + 1, dtype=np.int64), largest, sb.nvme_staged // 4)


def nvme_drive_bytes(layout: ChunkLayout, sb: StateBytes, world: int, n_nvme):
    """Drive space the last ``n_nvme`` chunks' states take on one rank: their state file
    (``nvme_file_top``)."""
    return nvme_file_top(layout, sb, world)[np.asarray(n_nvme)]


def norm_scratch_bytes(profile: ModelProfile, layout: ChunkLayout, clipping: bool,
                       grad_accumulation: bool) -> np.ndarray:
    """Per n_persist (0 .. n_chunks): device bytes of the fp32 copy a clipping norm makes of a
    16-bit gradient. Each offloaded chunk's parameter norms are taken on the device as its
    gradients leave, in DeepSpeed's arithmetic, ``g.float().norm(2)`` - kept because
    ``vector_norm(g, dtype=float32)`` reads 16-bit input with another reduction layout on
    CUDA (not the same bits) - one parameter at a time: 4 bytes x the largest parameter in
    chunks n_persist and after. 0 in fp32 (``float()`` is the tensor itself), without
    clipping, and with accumulation (the norms are then taken on the host). Added to the
    peak wherever in backward it happens (a bound)."""
    n = layout.n_chunks
    out = np.zeros(n + 1, dtype=np.int64)
    if not clipping or grad_accumulation or profile.param_bytes >= 4 or n == 0:
        return out
    largest = np.zeros(n, dtype=np.int64)
    for rec, c in zip(profile.params, layout.param_chunk):
        largest[c] = max(largest[c], rec.numel)
    out[:n] = 4 * np.maximum.accumulate(largest[::-1])[::-1]
    return out


# ---- activations ----------------------------------------------------------------------
def part_modes(profile: ModelProfile, block_modes: np.ndarray) -> np.ndarray:
    """Expand per-block mode codes [K, n_blocks] to per-part codes [K, n_parts] (pre and post
    are always NONE)."""
    block_modes = np.atleast_2d(np.asarray(block_modes, dtype=np.int8))
    out = np.zeros((block_modes.shape[0], len(profile.parts)), dtype=np.int8)
    out[:, list(profile.block_part_indices)] = block_modes
    return out


def activation_walk(profile: ModelProfile, block_modes) -> tuple[np.ndarray, np.ndarray]:
    """Highest live activation bytes for each row of per-block mode codes [K, n_blocks], and
    the walk point where it happens (2*part for forward, 2*part+1 for backward)."""
    walk = activation_walk_points(profile, block_modes)
    where = walk.argmax(axis=1)
    return np.maximum(walk.max(axis=1), 0), where


def activation_walk_points(profile: ModelProfile, block_modes) -> np.ndarray:
    """Live activation bytes at each walk point [K, 2 * parts]: each part's forward peak, then
    its backward peak (the curve under a predicted timeline)."""
    m = part_modes(profile, block_modes)
    parts = profile.parts
    saved = np.array([p.saved_bytes for p in parts], dtype=np.int64)
    inb = np.array([p.in_bytes for p in parts], dtype=np.int64)
    fs = np.array([p.fwd_start for p in parts], dtype=np.int64)
    fp = np.array([p.fwd_peak for p in parts], dtype=np.int64)
    bs = np.array([p.bwd_start for p in parts], dtype=np.int64)
    bp = np.array([p.bwd_peak for p in parts], dtype=np.int64)
    kept = np.array([p.kept_bytes for p in parts], dtype=np.int64)
    resaved = np.array([p.resaved_bytes for p in parts], dtype=np.int64)
    held = inb - np.array([p.in_shared_bytes for p in parts], dtype=np.int64)
    attn = np.maximum(np.array([p.sel_saved_bytes for p in parts], dtype=np.int64) - inb, 0)

    offl = (m == SWAP) | (m == SSD)       # host and NVMe offload leave the device alike
    prev_offl = np.zeros_like(offl)
    prev_offl[:, 1:] = offl[:, :-1]
    next_offl = np.zeros_like(offl)
    next_offl[:, :-1] = offl[:, 1:]
    # Kept storages stay while the next part holds them; an offloading next part lets go too.
    own = saved - kept
    own_offl = saved - np.where(next_offl, 0, kept)
    input_out = np.isin(m, INPUT_MOVED)      # the input left the device (host memory or drive)
    freed = np.where(m == CKPT, own - held, 0) + np.where(offl, own_offl, 0) + \
        np.where(m == SEL, own - held - attn, 0) + np.where(input_out, own, 0)
    # X_k: what earlier blocks' modes freed (exclusive prefix sum).
    x = np.cumsum(freed, axis=1) - freed
    # One offloaded block may be in flight: its write-out during the next part's forward, its
    # prefetch during the next (in backward order) part's backward. Its copies include the
    # storages it re-saved, which are gone from the device if their owner offloaded them.
    prev_swapped = np.zeros_like(freed)
    prev_swapped[:, 1:] = np.where(offl, own_offl + np.where(prev_offl, resaved, 0),
                                   np.where(input_out, held, 0))[:, :-1]

    fwd = fp - x + prev_swapped
    bwd_keep = bp - x
    recompute = bs - x - (saved - held) + (fp - fs)
    # Two offloaded blocks in a row both bring back the storages they share (each its copy).
    twice = np.where(offl & prev_offl, resaved, 0)
    rec = (m == CKPT) | (m == SEL) | input_out
    bwd = np.where(rec, np.maximum(recompute, bwd_keep), bwd_keep) + prev_swapped + twice
    return np.stack([fwd, bwd], axis=2).reshape(m.shape[0], -1)


def least_activation_peak(profile: ModelProfile) -> int:
    """A lower bound on ``activation_walk``'s peak over every block layout, without walking
    any: each walk point less the most every block before it can free whatever its mode (its
    saved bytes, or what a recompute or an offload gives back, the largest of them), and the
    least a block in flight can add (none, unless a figure is negative). The search's floor
    for a variant before its activation configurations are built
    (``search.pairs.activation_free_floor``); tests/test_search.py checks it against every
    layout of small models."""
    parts = profile.parts
    if not parts:
        return 0
    saved = np.array([p.saved_bytes for p in parts], dtype=np.int64)
    kept = np.array([p.kept_bytes for p in parts], dtype=np.int64)
    held = np.array([p.in_bytes - p.in_shared_bytes for p in parts], dtype=np.int64)
    block = np.zeros(len(parts), dtype=bool)
    block[list(profile.block_part_indices)] = True
    own = saved - kept
    freed_most = np.where(block, np.maximum.reduce([saved, own, own - held, np.zeros_like(saved)]), 0)
    x_most = np.cumsum(freed_most) - freed_most
    # In flight (``prev_swapped``): the part before's own_offl (>= own), or its held input, or 0.
    inflight = np.where(block, np.minimum.reduce([own, held, np.zeros_like(saved)]), 0)
    least_in = np.zeros_like(inflight)
    least_in[1:] = inflight[:-1]
    fp = np.array([p.fwd_peak for p in parts], dtype=np.int64)
    bp = np.array([p.bwd_peak for p in parts], dtype=np.int64)
    return max(0, int((np.maximum(fp, bp) - x_most + least_in).max()))


def offload_bytes(part) -> int:
    """Bytes a SWAP / SSD part copies off the device: every storage it saved, including those
    an earlier part saved first (each offloaded block keeps its own copies)."""
    return part.saved_bytes + part.resaved_bytes


def ckpt_input_bytes(part) -> int:
    """Bytes a CKPT_HOST / CKPT_SSD part copies off the device and back: its input."""
    return part.in_bytes


def activation_file_space(ssd_total, n_blocks: int):
    """Drive space the block files of ``ssd_total`` written bytes take, at most ``n_blocks``
    files (what the drive must have free: ``activation_file_bytes`` per file)."""
    return np.where(np.asarray(ssd_total) > 0,
                    np.ceil(np.asarray(ssd_total) * ACTIVATION_FILE_HEADROOM) + n_blocks * ACTIVATION_FILE_SLACK, 0)


def ssd_bytes(profile: ModelProfile, block_modes) -> np.ndarray:
    """Bytes the SSD blocks (and the CKPT_SSD blocks' inputs) write per iteration (and the disk
    space they need)."""
    m = part_modes(profile, block_modes)
    copied = np.array([offload_bytes(p) for p in profile.parts], dtype=np.int64)
    inputs = np.array([ckpt_input_bytes(p) for p in profile.parts], dtype=np.int64)
    return np.where(m == SSD, copied, 0).sum(axis=1) + np.where(m == CKPT_SSD, inputs, 0).sum(axis=1)


def swap_host_bytes(profile: ModelProfile, block_modes) -> np.ndarray:
    """Pinned host bytes holding the swapped blocks' activations and the CKPT_HOST blocks'
    inputs (all of them by the end of forward)."""
    m = part_modes(profile, block_modes)
    copied = np.array([offload_bytes(p) for p in profile.parts], dtype=np.int64)
    inputs = np.array([ckpt_input_bytes(p) for p in profile.parts], dtype=np.int64)
    return np.where(m == SWAP, copied, 0).sum(axis=1) + np.where(m == CKPT_HOST, inputs, 0).sum(axis=1)


# ---- one plan, explained ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MemoryPrediction:
    peak_device_bytes: int
    """Predicted peak of allocated device bytes (model states + activation peak + the clipping
    norm's fp32 scratch)."""
    model_state_bytes: int
    """Persistent chunks and chunk buffers."""
    activation_peak_bytes: int
    """Highest live activation bytes of the walk."""
    peak_at: str
    """Where the peak happens, e.g. ``backward of transformer.h.47``."""
    host_bytes: int
    """Pinned host bytes: offloaded chunk states plus swapped activations."""
    swap_host_bytes: int
    """Of which swapped activations."""
    ssd_bytes: int = 0
    """Activations written to NVMe per iteration (disk space needed)."""
    norm_scratch_bytes: int = 0
    """The clipping norm's fp32 copy of one 16-bit gradient (``norm_scratch_bytes``)."""
    nvme_state_bytes: int = 0
    """Drive space the NVMe chunks' optimizer states take: the state file as the runtime lays
    it out (both slots, padded fields; ``nvme_file_top``)."""
    nvme_state_io_bytes: int = 0
    """Bytes of optimizer states read from the drive and written back per optimizer step."""
    staging_bytes: int = 0
    """Of ``host_bytes``, the staging ring the NVMe chunks' states stream through."""


def predict_memory(profile: ModelProfile, layout: ChunkLayout, n_persist: int, n_buffer: int,
                   modes: tuple[BlockMode, ...], sb: StateBytes | None = None,
                   world: int = 1, norm_scratch: int = 0, n_nvme: int = 0, n_shard: int = 0) -> MemoryPrediction:
    """``norm_scratch``: ``norm_scratch_bytes(...)[n_persist]``."""
    sb = sb or state_bytes(profile.param_bytes)
    codes = np.array([[m.code for m in modes]], dtype=np.int8)
    act, where = activation_walk(profile, codes)
    states = int(model_state_device_bytes(layout, n_persist, n_buffer, sb, world, n_shard))
    swap = int(swap_host_bytes(profile, codes)[0])
    host = int(model_state_host_bytes(layout, n_persist, sb, world, n_nvme)) + swap
    w = int(where[0])
    peak_at = f"{'forward' if w % 2 == 0 else 'backward'} of {profile.parts[w // 2].name}"
    return MemoryPrediction(
        peak_device_bytes=states + int(act[0]) + norm_scratch, model_state_bytes=states,
        activation_peak_bytes=int(act[0]), peak_at=peak_at, host_bytes=host, swap_host_bytes=swap,
        ssd_bytes=int(ssd_bytes(profile, codes)[0]), norm_scratch_bytes=norm_scratch,
        nvme_state_bytes=int(nvme_drive_bytes(layout, sb, world, n_nvme)),
        nvme_state_io_bytes=int(nvme_state_top(layout, sb, world)[n_nvme]
                                + nvme_state_top(layout, sb, world, staged=True)[n_nvme]),
        staging_bytes=int(staging_bytes(layout, sb, world, n_nvme)))


__all__ = ["StateBytes", "state_bytes", "model_state_device_bytes", "sharded_state_bytes", "norm_scratch_bytes",
           "model_state_host_bytes", "nvme_state_top", "staging_bytes", "nvme_drive_bytes", "nvme_file_top",
           "activation_walk", "offload_bytes", "ckpt_input_bytes", "swap_host_bytes", "ssd_bytes", "MemoryPrediction",
           "predict_memory", "NONE", "CKPT", "SWAP"]
