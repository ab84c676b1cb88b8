"""Where an offloaded chunk's optimizer states live: pinned host memory, or NVMe (issue 27).

``Knobs.n_nvme`` counts the offloaded chunks whose optimizer states (the fp32 master where it is
separate from the parameters, exp_avg, exp_avg_sq) live on the drive under ``ssd_path``. They
are the last chunks: backward reaches them first, so their updates have the most time to hide
the reads and write-backs around them. Their parameters (uploaded every iteration) and gradients
stay in host memory. CPU Adam streams their states through ``STAGING_SLOTS`` pinned buffers of
one chunk's states each (read chunk k+1 while updating chunk k and writing back chunk k-1),
counted in the host budget. The runtime (``runtime.nvme_states``) and the cost model both read
this module, so they agree on which chunks, how much staging, and how large the state file is
(``state_file_bytes``: the runtime lays the file out with it, the planner prices it with it).
"""
from __future__ import annotations

STAGING_SLOTS = 3
"""Pinned staging buffers, each one offloaded chunk's optimizer states: one being read, one
being updated, one being written back."""


NVME_STATE_SLOTS = 2
"""Copies of an NVMe chunk's states the drive holds room for: the committed states and the
other slot a speculative update writes into (committed by switching, rolled back by reading
the old one), so speculation needs no backup in host memory (``state_file_bytes``)."""

FIELD_ALIGN = 4096
"""Alignment of every field in the state file and in a staging buffer: ``runtime.storage.ALIGN``
(O_DIRECT wants 4 KiB-aligned offsets, sizes and memory), repeated here so that the planner,
which does not import the runtime, lays the file out as the runtime does."""


def nvme_chunk_ids(n_chunks: int, n_persist: int, n_nvme: int) -> range:
    """The chunk indices whose optimizer states live on NVMe: the last ``n_nvme`` chunks."""
    offloaded = n_chunks - n_persist
    if not 0 <= n_nvme <= max(0, offloaded):
        raise ValueError(f"n_nvme={n_nvme}: states on NVMe are those of offloaded chunks, and "
                         f"{max(0, offloaded)} of {n_chunks} chunks are offloaded (n_persist={n_persist})")
    return range(n_chunks - n_nvme, n_chunks)


def state_bytes_per_element(master_separate: bool) -> int:
    """Bytes of optimizer state per parameter element: exp_avg and exp_avg_sq in fp32, and the
    fp32 master when the parameters are 16-bit (in fp32 training the parameter is the master)."""
    return 12 if master_separate else 8


def staged_bytes_per_element(master_separate: bool, speculative: bool) -> int:
    """Bytes per parameter element of a staging buffer, of one place on the drive and of a
    write-back: the optimizer states, and in fp32 training with speculation the master from
    before a speculative update (a rollback reads it back into the parameters)."""
    return state_bytes_per_element(master_separate) + (4 if speculative and not master_separate else 0)


def field_stride(largest_shard):
    """Bytes of one field: one fp32 tensor of the largest NVMe chunk's shard (elements), 4 KiB
    aligned. Every chunk's fields take this stride, the smaller chunks' too, so that any
    chunk's states fit any staging buffer. Works on numpy arrays as on ints."""
    return -(-4 * largest_shard // FIELD_ALIGN) * FIELD_ALIGN


def state_file_bytes(n_chunks, largest_shard, fields: int):
    """Bytes of the state file of ``n_chunks`` NVMe chunks whose largest shard has
    ``largest_shard`` elements: each chunk takes ``NVME_STATE_SLOTS`` places of ``fields``
    fields (``staged_bytes_per_element // 4``) of ``field_stride`` bytes. What the runtime
    preallocates and the planner checks against the drive's free space."""
    return n_chunks * NVME_STATE_SLOTS * fields * field_stride(largest_shard)


def staging_ring_bytes(largest_shard, fields: int, slots: int = STAGING_SLOTS):
    """Pinned host bytes of the staging ring: ``slots`` buffers of ``fields`` fields, each
    allocated ``FIELD_ALIGN`` larger so that an aligned view of it can be taken."""
    return slots * (fields * field_stride(largest_shard) + FIELD_ALIGN)
