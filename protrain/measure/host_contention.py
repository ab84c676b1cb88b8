"""How much of its host one rank gets when the node's ranks update at once.

The probe measures the node's host rates with one process on all the node's cores
(``measure.probe``). What each of ``ranks_per_node`` ranks gets of them while all run CPU Adam
together depends on what bounds the kernel: where the node's memory bandwidth does (a GPU
server's tens of cores streaming four fp32 arrays), about 1/ranks_per_node; where cores do
and one OpenMP team scales badly over them (few cores, a fork and join per update), more -
the ranks' separate teams together outrun the one. Priced as 1/ranks_per_node, 2 ranks on this
project's 2-core VM were predicted 25-30% slower than measured when the VM was quiet.

Measured directly here: the native kernel (csrc/cpu_adam.cpp: threads given per call, the
GIL released for the whole update) run by ``ranks_per_node`` host threads at once, each
with its rank's share of the cores in an OpenMP team of its own, as each rank's process has;
against the same kernel run alone by one team on all the cores. One rank's rate over the
node's is ``HardwareProfile.host_share``, the fraction ``cost.host_share`` prices each rank at.
Threads rather than processes: the probe runs while the node's other ranks wait for its result,
and starting ranks_per_node interpreters would cost seconds; each team runs as a process's
would (its own OpenMP pool), and the arrays are each thread's own, so no cache line is shared.
"""
from __future__ import annotations

import threading
import time

import torch

WINDOW_S = 0.2
"""Seconds each timed round runs the kernel (every team for the whole window, so they overlap
throughout)."""
ROUNDS = 3
"""Alternating rounds alone and together; the best of each is kept (other load only slows)."""


def measure_host_share(ranks_per_node: int, cores: int, params: int, *,
                       rounds: int = ROUNDS, window_s: float = WINDOW_S) -> float:
    """The fraction of the node's CPU Adam rate one of ``ranks_per_node`` ranks gets while all
    update at once, each with its share of ``cores`` (``runtime.node.NodeShare``), ``params``
    parameters per update. 1.0 for one rank; 0.0 where the native kernel is not available
    (no compiler: the cost model then assumes 1/ranks_per_node)."""
    if ranks_per_node <= 1:
        return 1.0
    from ..runtime.node import NodeShare
    threads = NodeShare(ranks_per_node=ranks_per_node, local_rank=0, cores=cores).threads
    try:
        teams = [_Updates(params, threads) for _ in range(ranks_per_node)]
        node = _Updates(params, cores, arrays=teams[0])
    except Exception:  # noqa: BLE001 - no compiler / no memory: not measured
        return 0.0
    alone, together = 0.0, 0.0
    for _ in range(rounds):
        alone = max(alone, _run([node], window_s)[0])
        together = max(together, min(_run(teams, window_s)))
    return min(1.0, together / alone) if alone > 0 else 0.0


class _Updates:
    """One team's CPU Adam updates over arrays of its own."""

    def __init__(self, params: int, threads: int, arrays: "_Updates | None" = None):
        from ..runtime.adam import AdamHyper, NativeCPUAdamKernel
        self.kernel = NativeCPUAdamKernel(adamw=True, threads=threads)
        self.hyper = AdamHyper(lr=1e-6, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                               bias_correction=True, adamw=True)
        self.arrays = arrays.arrays if arrays is not None else \
            (torch.zeros(params), torch.full((params,), 1e-3), torch.zeros(params), torch.zeros(params))
        self.step = 0
        self.update()                                # pages touched, kernel warm

    def update(self) -> None:
        self.step += 1
        self.kernel.update(*self.arrays, self.step, self.hyper)

    def rate(self, start: threading.Barrier, window_s: float, out: list, i: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        n = 0
        while (elapsed := time.perf_counter() - t0) < window_s or n == 0:
            self.update()
            n += 1
        out[i] = n * self.arrays[0].numel() / elapsed


def _run(teams: list[_Updates], window_s: float) -> list[float]:
    """Parameters/s of each team, all started at once and run for ``window_s``."""
    start = threading.Barrier(len(teams))
    out = [0.0] * len(teams)
    workers = [threading.Thread(target=t.rate, args=(start, window_s, out, i), daemon=True)
               for i, t in enumerate(teams)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return out
