"""Data-parallel collectives on chunks: all-gather of parameter shards, reduce-scatter of
gradients, all-reduce of replicated (persistent) gradients and of scalars.

ZeRO-3 style: an offloaded chunk of n elements is split into ``world`` shards of
ceil(n / world) elements (the buffer is padded to a multiple of the world size); rank r keeps
shard r of the chunk's host states. On CUDA (NCCL) the gather and the scatter run in place in
the chunk buffer on the copy streams; gloo (CPU tests) gets a copy of the input.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

# torch renamed the tensor collectives (all_gather_into_tensor -> all_gather_single); use
# whichever this torch has.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DataParallel:
    """The data-parallel group a runtime shards over (world 1: every method is a no-op)."""

    def __init__(self, group=None):
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.world = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        else:
            self.world, self.rank = 1, 0

    @classmethod
    def one_rank(cls) -> "DataParallel":
        """A world of one whatever process group runs (work one rank does alone, e.g. a probe
        the other ranks wait for)."""
        dp = cls.__new__(cls)
        dp.group, dp.world, dp.rank = None, 1, 0
        return dp

    def shard(self, numel: int) -> tuple[int, int, int]:
        """(start, stop, shard size) of this rank's part of ``numel`` elements; the part may be
        shorter than the shard size (or empty) at the end of the chunk."""
        size = -(-numel // self.world)
        lo = min(self.rank * size, numel)
        return lo, min(lo + size, numel), size

    def all_gather_(self, buf: torch.Tensor, size: int) -> None:
        """buf[:world * size] <- every rank's buf[rank * size:(rank + 1) * size]."""
        if self.world == 1:
            return
        mine = buf[self.rank * size:(self.rank + 1) * size]
        _all_gather(buf[:self.world * size], mine if buf.is_cuda else mine.clone(), group=self.group)

    def reduce_scatter_(self, buf: torch.Tensor, size: int) -> torch.Tensor:
        """Sum buf[:world * size] over ranks into this rank's shard; returns the shard."""
        mine = buf[self.rank * size:(self.rank + 1) * size]
        if self.world == 1:
            return mine
        full = buf[:self.world * size]
        _reduce_scatter(mine, full if buf.is_cuda else full.clone(), group=self.group)
        return mine

    def all_reduce_(self, t: torch.Tensor, op=None) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group)
        return t

    def all_reduce_start(self, t: torch.Tensor):
        """Start summing ``t`` over the ranks in place; returns the collective's handle, whose
        ``wait()`` must come before ``t`` is read or written again (None with one rank). On
        CUDA (NCCL) the sum runs on the communicator's stream after the work queued on the
        current stream, and ``wait()`` makes the current stream wait for it; with gloo a
        background thread reads and writes ``t`` until ``wait()`` returns."""
        if self.world == 1:
            return None
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def rendezvous(self, what: str, timeout_s: float | None = None, fix: str = "") -> None:
        """Return once every rank of the group has called this (with the same ``what``), before a
        collective only some ranks might enter: a call made on some ranks only fails after
        ``timeout_s`` (None: the process group's own timeout, what the collective itself would
        wait) with the ranks that never came and ``fix``, instead of hanging in the collective
        (or pairing with another one). The ranks meet in the process group's key-value store;
        a rank that waits 30 s says so once. Without a store to meet in: nothing to wait for."""
        if self.world == 1:
            return
        store = _store()
        if store is None:
            return
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(self.world))
        tag = f"protrain/{what}/{'-'.join(map(str, ranks))}"
        n = _RENDEZVOUS.get(tag, 0)
        key = f"{tag}/{n}"
        if n >= 2:      # every rank passed it: each arrived at n - 1 after passing n - 2
            _forget(store, f"{tag}/{n - 2}/{self.rank}")
            if self.rank == 0:
                _forget(store, f"{tag}/{n - 2}")
        store.set(f"{key}/{self.rank}", "1")          # who came (for the message)
        store.add(key, 1)                             # how many came (what is polled)
        limit = timeout_s if timeout_s is not None else dist.default_pg_timeout.total_seconds()
        start, pause, warned = time.monotonic(), 0.001, False
        while store.add(key, 0) < self.world:
            waited = time.monotonic() - start
            if waited > limit or (waited > 30 and not warned):
                missing = [r for r in range(self.world) if not store.check([f"{key}/{r}"])]
            if waited > limit:
                store.add(key, -1)                    # not arrived: the next call is this one
                _forget(store, f"{key}/{self.rank}")
                raise RuntimeError(
                    f"ProTrain: {what} is a collective over the {self.world} data-parallel ranks "
                    f"(their parameters are sharded), and rank(s) {missing} did not call it within "
                    f"{limit:.0f} s of rank {self.rank}. Every rank must call it, as with "
                    f"ZeRO-3. {fix}")
            if waited > 30 and not warned:
                warned = True
                print(f"ProTrain: rank {self.rank} has waited {waited:.0f} s in {what} for rank(s) "
                      f"{missing}: every rank must call it (it fails after {limit:.0f} s). {fix}",
                      flush=True)
            time.sleep(pause)
            pause = min(2 * pause, 0.5)
        _RENDEZVOUS[tag] = n + 1

    def broadcast_object(self, obj, src: int = 0):
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        if self.world == 1:
            return [obj]
        box = [None] * self.world
        dist.all_gather_object(box, obj, group=self.group)
        return box

    def all_to_all_(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                    in_splits: list[int]) -> torch.Tensor:
        """out <- the parts of every rank's ``inp`` meant for this rank (``in_splits[r]``
        elements of ``inp`` go to rank r, ``out_splits[r]`` come from it), in rank order."""
        if self.world == 1:
            out.copy_(inp)
        else:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        return out


def host_side(dp: DataParallel) -> DataParallel:
    """The ranks of ``dp`` over gloo, for small messages in host memory that every rank needs
    at once (the batch shape at each forward, states moved at a re-plan). With NCCL a
    collective on a host value needs a device copy and a read back to the host, which makes
    the host wait until the device's queue has drained to that point: every micro-batch the
    host would stop running ahead of the device (the chunk prefetches and CPU Adam it queues
    meanwhile). Gloo moves host tensors over TCP without touching the device: a round trip of
    tens of microseconds. The group is made once (a collective: every rank, same order)."""
    if dp.world == 1 or dist.get_backend(dp.group) == "gloo":
        return dp
    ranks = tuple(dist.get_process_group_ranks(dp.group)) if dp.group is not None else None
    # One per process group and ranks: engines built again in the same job reuse it.
    key = (id(dist.distributed_c10d._get_default_group()), ranks)
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = dist.new_group(ranks=list(ranks) if ranks else None, backend="gloo")
    return DataParallel(_HOST_GROUPS[key])


_HOST_GROUPS: dict = {}

_RENDEZVOUS: dict[str, int] = {}
"""Rendezvous made so far per (what, group): every rank counts the same sequence."""


def _store():
    """The default process group's key-value store (torch has no public accessor for it), or
    None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _forget(store, key: str) -> None:
    try:
        store.delete_key(key)
    except (RuntimeError, NotImplementedError):   # a store without deletion keeps a few bytes
        pass
