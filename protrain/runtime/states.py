"""Optimizer-level state of a runtime, per parameter: export it (checkpoints, re-planning)
and import it into another runtime, whatever its chunk layout or world size (``RuntimeState``
is what passes between them).

A *piece* is what one rank holds of one parameter: an element range [lo, hi) of the flattened
parameter with its fp32 master values, Adam m and v, and the parameter's step count. A
persistent chunk's parameters are replicated, so only rank 0 exports them; an offloaded
chunk's parameters are exported shard by shard. Together the pieces of all ranks cover every
parameter exactly once, which is what lets a checkpoint taken on N ranks load on M.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from .chunks import Chunk, ChunkManager
from .collectives import DataParallel


@dataclass
class Piece:
    name: str
    lo: int
    hi: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int
    grad: torch.Tensor | None = None
    """Gradients accumulated so far in this optimizer step (fp32), when exported with them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeState:
    """The model states a runtime hands to another (``ProTrainRuntime.export_state`` /
    ``import_state``): a re-plan's, or a checkpoint's read back."""

    pieces: list[Piece]
    """The pieces: this rank's (``local``) or every rank's."""
    local: bool = True
    """The pieces are this rank's only (a re-plan's export: with several ranks they are
    exchanged on import, since the new plan shards otherwise); False: every rank's (a
    checkpoint's files), from which each rank cuts what it holds."""
    optimizer_states: bool = True
    """Import Adam's moments and step counts; False: the weights only, Adam starts afresh."""
    grads: bool = False
    """The pieces carry the gradients accumulated so far in the optimizer step in progress."""
    adam_chain: tuple[int, int] | None = None
    """(step, last step): the host Adam kernels' beta^t where the states were made -
    computed with pow() at the first, multiplied by beta once per step to the second
    (``ProTrainRuntime._adam_chain``); None: an uninterrupted run to the largest step count."""


def _local_range(m: ChunkManager, c: Chunk) -> tuple[int, int]:
    """Chunk elements this rank's tensors of ``c`` hold."""
    return (0, c.numel) if c.persistent else (c.shard_lo, c.shard_hi)


def export_pieces(m: ChunkManager, *, grads: bool = False) -> list[Piece]:
    """This rank's pieces. With ``grads``, also the gradients accumulated in this optimizer
    step (micro-batches before an accumulation boundary), as the step would apply them: an
    offloaded chunk's shard holds them averaged over the ranks already (its reduce-scatter),
    a persistent chunk's are this rank's own until the step's all-reduce, so they are averaged
    here (a collective then: every rank calls it). Imported into persistent chunks on every
    rank, the step averages them again, exactly when the world size is a power of two.

    The states of chunks on NVMe are not copied: their pieces are read-only views of the state
    file (``NvmeStates.mapped``) and, in fp32, of the parameters, so a checkpoint or a re-plan
    of states that do not fit in host memory streams them from the drive instead of holding
    them. Such pieces are valid until the runtime changes its states again (its next step):
    save or import them before."""
    m.host_sync()            # CPU Adam of the last step may still be running on offloaded chunks
    pieces = []
    with (m.nvme.mapped() if m.nvme is not None else nullcontext()) as on_drive:
        for c in m.chunks:
            averaged = None
            if grads and c.persistent and m.dp.world > 1:
                averaged = m.dp.all_reduce_(c.grad.clone()).div_(m.dp.world)
            if c.persistent and m.dp.rank != 0:
                continue
            acc = averaged if averaged is not None else c.grad if c.persistent else c.grad_acc
            states = partial(_drive_states, on_drive, c) if m.on_nvme(c) else partial(_host_states, c)
            pieces += _chunk_pieces(m, c, states, acc if grads else None)
    return pieces


def _host_states(c: Chunk, a: int, b: int) -> list[torch.Tensor]:
    """Elements [a, b) of ``c``'s local master, exp_avg and exp_avg_sq: an offloaded chunk's
    as ``host_fp32`` (no copy), a persistent chunk's copied (device memory, which a re-plan
    after an out-of-memory error must free before the new runtime allocates)."""
    if c.persistent:
        return [t[a:b].detach().float().cpu().clone() for t in (c.master, c.exp_avg, c.exp_avg_sq)]
    return [host_fp32(t[a:b]) for t in (c.master, c.exp_avg, c.exp_avg_sq)]


def host_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 on the host. An fp32 host tensor (an offloaded chunk's states) is not
    copied: a copy into pageable memory took 12 bytes per parameter beyond the host budget at
    every checkpoint save and re-plan (issue 35, item 6; an OOM kill at 70B). It is a zero-copy
    tensor with a storage of its own over the range (through numpy: ``torch.save`` writes a
    view's whole storage), valid until the runtime changes its states again (the next step),
    like the states on the drive. Device or 16-bit tensors are copied."""
    t = t.detach()
    if t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous():
        return torch.from_numpy(t.numpy())
    return t.float().cpu().clone()


def _drive_states(on_drive, c: Chunk, a: int, b: int) -> list[torch.Tensor]:
    """Elements [a, b) of the states of ``c`` (a chunk on NVMe): views of the state file, and in
    fp32 a view of the master, which is the parameters in host memory (a storage of its own
    through numpy: ``torch.save`` writes a view's whole storage)."""
    states = on_drive(c, a, b)
    if len(states) == 2:
        states.insert(0, torch.from_numpy(c.master[a:b].detach().numpy()))
    return states


def _chunk_pieces(m: ChunkManager, c: Chunk, states: Callable[[int, int], list[torch.Tensor]],
                  acc: torch.Tensor | None) -> list[Piece]:
    """The pieces ``c``'s tensors hold, their master and Adam moments from ``states(a, b)``
    (elements [a, b) of this rank's part of the chunk), with the gradients in ``acc`` if given."""
    lo, hi = _local_range(m, c)
    out = []
    for s in c.slots:
        a, b = max(s.offset, lo), min(s.stop, hi)
        if a >= b:
            continue
        sl = slice(a - lo, b - lo)
        out.append(Piece(s.name, a - s.offset, b - s.offset, *states(a - lo, b - lo), s.step,
                         _grads(c, acc[sl]) if acc is not None else None))
    return out


def _grads(c: Chunk, acc: torch.Tensor) -> torch.Tensor:
    return acc.detach().float().cpu().clone() if c.persistent else host_fp32(acc)


def held_ranges(m: ChunkManager) -> list[tuple[str, int, int]]:
    """(parameter, lo, hi): the element ranges of each parameter this rank's chunks hold."""
    out = []
    for c in m.chunks:
        lo, hi = _local_range(m, c)
        for s in c.slots:
            a, b = max(s.offset, lo), min(s.stop, hi)
            if a < b:
                out.append((s.name, a - s.offset, b - s.offset))
    return out


def redistribute(pieces: list[Piece], m: ChunkManager, dp: DataParallel) -> list[Piece]:
    """The pieces this rank's chunks in ``m`` hold, cut out of every rank's ``pieces`` (taken
    from another layout or sharding: a re-plan). Every rank sends each rank the parts of its
    pieces that rank holds now, in one all-to-all over ``dp`` (host tensors: a gloo group);
    what a rank receives is what its chunks need, nothing more. A collective."""
    index = [(p.name, p.lo, p.hi, p.step, p.grad is not None) for p in pieces]
    meta = dp.all_gather_object((index, held_ranges(m)))

    def segments(src: int, dst: int) -> list[tuple[int, int, int, int]]:
        """(piece of ``src``, lo, hi, fields) for ``dst``, in an order both ranks compute."""
        by_name = defaultdict(list)
        for k, (name, lo, hi, _, grad) in enumerate(meta[src][0]):
            by_name[name].append((k, lo, hi, 4 if grad else 3))
        out = []
        for name, lo, hi in meta[dst][1]:
            for k, plo, phi, fields in by_name.get(name, ()):
                a, b = max(lo, plo), min(hi, phi)
                if a < b:
                    out.append((k, a, b, fields))
        return out
    send, in_splits = [], []
    for dst in range(dp.world):
        n = 0
        for k, a, b, fields in segments(dp.rank, dst):
            p = pieces[k]
            send += [t[a - p.lo:b - p.lo].float() for t in (p.master, p.exp_avg, p.exp_avg_sq, p.grad)
                     if t is not None]
            n += fields * (b - a)
        in_splits.append(n)
    incoming = [segments(src, dp.rank) for src in range(dp.world)]
    out_splits = [sum(f * (b - a) for _, a, b, f in segs) for segs in incoming]
    inp = torch.cat(send) if send else torch.empty(0)
    got = dp.all_to_all_(torch.empty(sum(out_splits)), inp, out_splits, in_splits)
    mine, at = [], 0
    for src, segs in enumerate(incoming):
        for k, a, b, fields in segs:
            name, step = meta[src][0][k][0], meta[src][0][k][3]
            n = b - a
            parts = [got[at + i * n:at + (i + 1) * n] for i in range(fields)]
            at += fields * n
            mine.append(Piece(name, a, b, *parts[:3], step, parts[3] if fields == 4 else None))
    return mine


def import_pieces(m: ChunkManager, fetch: Callable[[str, int, int], tuple], *,
                  optimizer_states: bool = True, grads: bool = False) -> None:
    """Fill every chunk from ``fetch(name, lo, hi) -> (master, exp_avg, exp_avg_sq, step)``
    (fp32 CPU tensors of hi - lo elements). Without ``optimizer_states`` only the weights are
    taken and Adam starts afresh."""
    m.host_sync()
    m.evict_all()
    for c in m.chunks:
        with m.host_states(c, write=True):         # written back to the drive for chunks on NVMe
            _fill_chunk(m, c, fetch, optimizer_states, grads)


def _fill_chunk(m: ChunkManager, c: Chunk, fetch, optimizer_states: bool, grads: bool) -> None:
    lo, hi = _local_range(m, c)
    for s in c.slots:
        a, b = max(s.offset, lo), min(s.stop, hi)
        if a >= b:
            continue
        master, ea, eas, step, *rest = fetch(s.name, a - s.offset, b - s.offset)
        sl = slice(a - lo, b - lo)
        acc = c.grad if c.persistent else c.grad_acc
        if grads and rest and rest[0] is not None and acc is not None:
            acc[sl].copy_(rest[0])
            s.has_grad = True
        c.master[sl].copy_(master)
        if optimizer_states:
            c.exp_avg[sl].copy_(ea)
            c.exp_avg_sq[sl].copy_(eas)
            s.step = int(step)
        else:
            c.exp_avg[sl].zero_()
            c.exp_avg_sq[sl].zero_()
            s.step = 0
    # The training-dtype copies follow the masters.
    if c.persistent:
        if c.master is not c.data:
            c.data.copy_(c.master)
    elif c.shadow is not None:
        c.shadow.copy_(c.master)
    m.device_states_written(c)         # a sharded chunk's next gather waits for these writes


def assemble(pieces_by_name: dict[str, list[Piece]], name: str, lo: int, hi: int) -> tuple:
    """Cut [lo, hi) of a parameter out of the pieces that cover it (any sharding):
    (master, exp_avg, exp_avg_sq, step, grad or None)."""
    out = [torch.empty(hi - lo) for _ in range(4)]
    covered = 0
    step = None
    with_grad = True
    for p in pieces_by_name.get(name, ()):
        a, b = max(p.lo, lo), min(p.hi, hi)
        if a >= b:
            continue
        with_grad = with_grad and p.grad is not None
        for dst, src in zip(out, (p.master, p.exp_avg, p.exp_avg_sq, p.grad)):
            if src is not None:
                dst[a - lo:b - lo].copy_(src[a - p.lo:b - p.lo])
        covered += b - a
        step = p.step if step is None else max(step, p.step)
    if covered != hi - lo:
        raise KeyError(f"the checkpoint does not cover {name}[{lo}:{hi}] ({covered} of {hi - lo} "
                       f"elements found); it was written for another model or is incomplete")
    return out[0], out[1], out[2], step, (out[3] if with_grad else None)
