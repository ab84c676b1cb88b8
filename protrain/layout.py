"""ChunkLayout: parameters packed into fixed-size chunks in execution order.

ProTrain manages model states per chunk: the first ``n_persist`` chunks stay on the device, the
others live in host memory and pass through ``n_buffer`` device buffers. Packing in order of
first use means chunks are needed in index order in forward and in reverse order in backward,
which is what lets one prefetch queue serve both directions.

Rules (the runtime follows the same layout, ``protrain.runtime`` builds it from this value):
- a parameter is never split: if it does not fit in the current chunk's free space, the next
  chunk starts; chunk capacity is never below the largest parameter;
- a shared parameter (tied embedding) lives in the chunk of its first use;
- a chunk whose users are not a contiguous run of parts (tied head and embedding) must stay
  persistent, since reloading it mid-iteration would split its gradient: ``min_persist``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .profile.model_profile import ModelProfile, ParamRecord


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    chunk_numel: int
    """Capacity of every chunk, in elements."""
    chunk_bytes: int
    """Capacity in bytes of the training dtype (what one device buffer takes)."""
    param_chunk: tuple[int, ...]
    """Chunk index of each parameter (same order as ModelProfile.params)."""
    used: tuple[int, ...]
    """Elements actually packed in each chunk."""
    part_chunks: tuple[tuple[int, ...], ...]
    """For each part, the chunks it uses (home and shared parameters), ascending."""
    part_chunk_share: tuple[tuple[float, ...], ...]
    """For each part, the share of its compute attributed to each of ``part_chunks`` (by the
    elements it uses in that chunk); parts without parameters get one share of 1.0 on no chunk."""
    chunk_first_part: tuple[int, ...]
    """First part (forward order) using each chunk: its gradient is complete after this part's
    backward."""
    chunk_last_part: tuple[int, ...]
    """Last part (forward order) using each chunk: its buffer is free after this part's forward."""
    min_persist: int
    """Fewest persistent chunks allowed (chunks with non-contiguous users must persist)."""

    @property
    def n_chunks(self) -> int:
        return len(self.used)

    @property
    def total_numel(self) -> int:
        return sum(self.used)

    def min_buffers(self, n_persist: int) -> int:
        """Fewest buffers that can run the non-persistent chunks: a part must be able to hold
        every chunk index between its first and last non-persistent chunk at once."""
        return int(self.min_buffers_table()[n_persist])

    def min_buffers_table(self) -> np.ndarray:
        """``min_buffers(n)`` for every n in 0..n_chunks: the widest index range of the
        non-persistent chunks (index >= n) any one part uses. Computed once per layout (the
        search asks for it at every block of points it fits); read-only."""
        known = _MIN_BUFFERS.get(id(self))
        if known is not None and known[0] is self:
            return known[1]
        table = self._min_buffers_table()
        table.flags.writeable = False
        if len(_MIN_BUFFERS) >= 64:
            _MIN_BUFFERS.pop(next(iter(_MIN_BUFFERS)))
        _MIN_BUFFERS[id(self)] = (self, table)
        return table

    def _min_buffers_table(self) -> np.ndarray:
        n = np.arange(self.n_chunks + 1, dtype=np.int64)
        out = np.zeros(self.n_chunks + 1, dtype=np.int64)
        for chunks in self.part_chunks:
            if not chunks:
                continue
            cs = np.asarray(chunks, dtype=np.int64)          # ascending
            lo = cs[np.minimum(np.searchsorted(cs, n), len(cs) - 1)]
            width = np.where(cs[-1] >= n, cs[-1] - lo + 1, 0)
            out = np.maximum(out, width)
        return out


def chunk_capacities(profile: ModelProfile, sizes_bytes: tuple[int, ...]) -> tuple[int, ...]:
    """Chunk capacities (elements) to try for the given byte sizes.

    Sizes below the largest parameter cannot hold it and are skipped; if none is left, the
    largest parameter's size rounded up to a MiB, and twice that, are tried. Sizes above the
    whole model would only waste buffer memory: they become the model's size, and halves,
    quarters and eighths of it are tried too, so small models still get several chunks.
    """
    return capacities(profile.largest_param, profile.total_params, profile.param_bytes, sizes_bytes)


def capacities(largest: int, total: int, w: int, sizes_bytes: tuple[int, ...]) -> tuple[int, ...]:
    """``chunk_capacities`` from the parameter counts alone (elements of the largest parameter
    and of all, ``w`` bytes each): known before profiling."""
    caps = {min(s // w, total) for s in sizes_bytes if s // w >= largest}
    if not caps:
        mib = 2**20
        base = ((largest * w + mib - 1) // mib) * mib // w
        caps = {base, 2 * base}
    if total in caps:
        caps |= {-(-total // k) for k in (2, 4, 8) if -(-total // k) >= largest}
    return tuple(sorted(caps))


_MIN_BUFFERS: dict[int, tuple[ChunkLayout, np.ndarray]] = {}
"""``ChunkLayout.min_buffers_table`` of the layouts asked last, by id (the layout kept with it,
so an id is not reused while its entry lives)."""


_LAYOUTS: dict[tuple, tuple[tuple, ChunkLayout]] = {}
"""``build_layout``'s layouts asked last, by (id of the parameters' records, parts, bytes,
capacity), the records kept with each so an id is not reused while its entry lives: a plan's
outer loops (tiles, where the checkpointed inputs go, sequence-parallel degrees) search the
same profile's parameters at the same capacities many times (77 layouts, 0.4 s, for a 70B
model on 8 ranks)."""


def build_layout(profile: ModelProfile, chunk_numel: int) -> ChunkLayout:
    key = (id(profile.params), len(profile.parts), profile.param_bytes, chunk_numel)
    known = _LAYOUTS.get(key)
    if known is not None and known[0] is profile.params:
        return known[1]
    layout = layout_of(profile.params, len(profile.parts), profile.param_bytes, chunk_numel)
    if len(_LAYOUTS) >= 64:
        _LAYOUTS.pop(next(iter(_LAYOUTS)))
    _LAYOUTS[key] = (profile.params, layout)
    return layout


def layout_of(params: tuple[ParamRecord, ...], n_parts: int, param_bytes: int,
              chunk_numel: int) -> ChunkLayout:
    """Pack ``params`` (in execution order) into chunks of ``chunk_numel`` elements."""
    largest = max((p.numel for p in params), default=0)
    if chunk_numel < largest:
        raise ValueError(f"chunk capacity {chunk_numel} elements is below the largest parameter "
                         f"({largest} elements); pick a larger chunk_size")
    param_chunk: list[int] = []
    used: list[int] = []
    for rec in params:
        if not used or used[-1] + rec.numel > chunk_numel:
            used.append(0)
        param_chunk.append(len(used) - 1)
        used[-1] += rec.numel

    # Which parts use which chunk, and how many elements of it.
    use = [dict() for _ in range(n_parts)]  # part -> {chunk: elements used}
    users: list[set[int]] = [set() for _ in used]
    for rec, c in zip(params, param_chunk):
        for p in rec.parts:
            use[p][c] = use[p].get(c, 0) + rec.numel
            users[c].add(p)

    part_chunks, part_share = [], []
    for p in range(n_parts):
        chunks = tuple(sorted(use[p]))
        tot = sum(use[p].values())
        part_chunks.append(chunks)
        part_share.append(tuple(use[p][c] / tot for c in chunks) if chunks else (1.0,))

    min_persist = 0
    for c, u in enumerate(users):
        if u and max(u) - min(u) + 1 != len(u):
            min_persist = c + 1
    return ChunkLayout(
        chunk_numel=chunk_numel,
        chunk_bytes=chunk_numel * param_bytes,
        param_chunk=tuple(param_chunk),
        used=tuple(used),
        part_chunks=tuple(part_chunks),
        part_chunk_share=tuple(part_share),
        chunk_first_part=tuple(min(u) if u else n_parts - 1 for u in users),
        chunk_last_part=tuple(max(u) if u else n_parts - 1 for u in users),
        min_persist=min_persist,
    )


def why_persistent(params: tuple[ParamRecord, ...], layout: ChunkLayout,
                   part_names: tuple[str, ...] = ()) -> str:
    """Why the first ``layout.min_persist`` chunks must stay on the device, in words: the
    last of them is used by parts that are not adjacent, and by which of its parameters (a
    parameter several parts share, such as tied embeddings; or parameters of parts far apart
    packed side by side)."""
    c = layout.min_persist - 1
    if c < 0:
        return "no chunk has to"

    def name(p: int) -> str:
        return part_names[p] if p < len(part_names) else f"part {p}"
    mine = [rec for rec, ch in zip(params, layout.param_chunk) if ch == c]
    users = sorted({p for rec in mine for p in rec.parts})
    gaps = [p for p in range(users[0], users[-1] + 1) if p not in users]
    shared = [rec for rec in mine if len(rec.parts) > 1 and
              max(rec.parts) - min(rec.parts) + 1 != len(rec.parts)]
    # Else parameters of parts far apart packed side by side: one from each end.
    named = shared or [next(r for r in mine if users[0] in r.parts),
                       next(r for r in mine if users[-1] in r.parts)]
    which = ", ".join(f"{rec.name} (used by {' and '.join(name(p) for p in rec.parts)})"
                      for rec in named[:3])
    return (f"chunk {c} is used by {', '.join(name(p) for p in users)} but not by "
            f"{', '.join(name(p) for p in gaps[:3])}{' ...' if len(gaps) > 3 else ''} in between: "
            f"it holds {which}")
