"""The ranks that share one host: how many, which one this process is, and the cores each
one's host work gets.

Every rank launched on a node runs its CPU Adam, the passes around it and its Python on the
same cores and the same memory bus. The cost model therefore prices a rank at 1/ranks_per_node
of the node's host rates (``cost.host_share``), and each rank's CPU Adam kernel takes its share
of the node's cores (``NodeShare.threads``), so that the ranks together use the node's cores
once rather than each all of them (8 ranks x all cores: 8x oversubscribed, OpenMP threads
descheduled in the middle of a parallel region and the whole update waiting for them).

What ``ranks_per_node`` is:

- at run time, what the launcher says: LOCAL_WORLD_SIZE (torchrun), LOCAL_SIZE (DeepSpeed's
  launcher), OMPI_COMM_WORLD_LOCAL_SIZE (mpirun); without one, with the ranks connected, one
  all-gather of host names counts the ranks on this host (``node_share``); before they are
  connected (Megatron's argument parsing), every rank of the launch is taken to be local, at
  most ``OFFLINE_RANKS_PER_NODE``;
- planning offline, ``protrain plan --ranks-per-node N`` (default: the world size, at most 8).

It lives in ``HardwareProfile.ranks_per_node``, so a prediction is a function of its inputs
alone, and the plan records it (``Plan.ranks_per_node``).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

OFFLINE_RANKS_PER_NODE = 8
"""Ranks per node assumed where nothing says (planning offline, a launch without a launcher's
variables before its ranks are connected): an ordinary GPU node holds 8 GPUs, one rank each."""

_LAUNCHER_VARS = (("LOCAL_WORLD_SIZE", "LOCAL_RANK"),             # torchrun
                  ("LOCAL_SIZE", "LOCAL_RANK"),                   # deepspeed's launcher
                  ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"))   # mpirun


@dataclass(frozen=True, slots=True)
class NodeShare:
    """This rank's part of its host."""

    ranks_per_node: int
    """Ranks launched on this host (this one included)."""
    local_rank: int
    """This rank's index among them."""
    cores: int
    """Cores the node's ranks run on (``node_cores``)."""

    @property
    def threads(self) -> int:
        """OpenMP threads of this rank's CPU Adam: the node's cores split among its ranks (at
        least one). The training loop's own threads (torch's intra-op pool, OMP_NUM_THREADS)
        are left as the user or the launcher set them."""
        return max(1, self.cores // self.ranks_per_node)


def node_cores() -> int:
    """Cores this process may run on: its CPU affinity (a container's cpuset included), which
    the ranks of an ordinary launch share. A launcher that pins each rank to cores of its own
    (``deepspeed --bind_cores_to_rank``) leaves a rank only its own: set
    ``protrain.cpu_adam_threads`` to them there."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):      # not Linux
        return max(1, os.cpu_count() or 1)


def from_launcher(world: int) -> tuple[int, int] | None:
    """(ranks per node, local rank) as the launcher's variables give them, or None."""
    for size_var, rank_var in _LAUNCHER_VARS:
        size = os.environ.get(size_var)
        if size and size.isdigit() and int(size) >= 1:
            rank = os.environ.get(rank_var, "0")
            return min(int(size), max(1, world)), int(rank) if rank.isdigit() else 0
    return None


def before_connect(world: int) -> NodeShare:
    """This rank's share where the ranks are not connected yet: the launcher's variables, else
    every rank of the launch on this host (at most ``OFFLINE_RANKS_PER_NODE``)."""
    local = from_launcher(world)
    if local is None:
        local = (max(1, min(world, OFFLINE_RANKS_PER_NODE)), int(os.environ.get("LOCAL_RANK", "0")))
    return NodeShare(ranks_per_node=local[0], local_rank=local[1], cores=node_cores())


def node_share(dp=None) -> NodeShare:
    """This rank's share of its host in the data-parallel group ``dp`` (None: one rank). Every
    rank must call it where the launcher does not say: the count is then one all-gather of
    host names over the group."""
    world = 1 if dp is None else dp.world
    local = from_launcher(world)
    if local is None and world > 1:
        import torch.distributed as dist
        names: list = [None] * world
        dist.all_gather_object(names, socket.gethostname(), group=dp.group)
        mine = socket.gethostname()
        local = (sum(n == mine for n in names), sum(n == mine for n in names[:dp.rank]))
    if local is None:
        local = (1, 0)
    return NodeShare(ranks_per_node=local[0], local_rank=local[1], cores=node_cores())
