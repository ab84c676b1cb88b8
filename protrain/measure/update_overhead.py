"""The runtime's own time per offloaded chunk update, beyond the work per parameter.

An offloaded chunk's update is more than the Adam kernel and the passes around it
(``cost.host_update``): in ``ChunkOptimizer.step`` each chunk takes its segments and their
hyperparameters, a task on the host worker, four tensor views per segment, the kernel call (an
OpenMP fork and join), the in-place pass calls, the gradient reset and the event its upload
waits on; the step combines the chunks' gradient norms. A few hundred microseconds of Python per
chunk on the 2-core CPU of this project, whatever the chunk's size: 41 chunks of 4 MiB made the
measured exposed CPU Adam 12-24% longer than kernel + passes predicted (bench/cpu_adam_exposed.py),
7 chunks of 16 MiB 6%. A real model's chunks are larger and this is noise there; the cost model
still adds it per chunk (``cost.chunk_times.chunk_transfer_times``), measured here.

Measured as the runtime spends it: the real ``ChunkOptimizer`` steps over offloaded chunks of
the size a real chunk has, in the state backward leaves them (gradients landed, each chunk's
part of the clipping norm taken, clipping on), with a host kernel that times its own calls
(the Adam kernel and its in-place scale pass); what the step takes beyond those calls, per
chunk, is the overhead. Chunk-sized data matters: each update streams tens of MB through the
caches, so the bookkeeping after it runs with the caches (instructions included) holding chunk
data, not Python - on the 2-core VM ~2.5x slower than after tiny chunks (83 us).
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

CHUNKS = 8
"""Offloaded chunks stepped."""
CHUNK_NUMEL = 1 << 20
"""Parameters per chunk: 4 MiB of fp32, the smallest chunk sizes the planner tries; the
update of one streams ~30 MB through the caches."""


def measure_update_overhead(reps: int = 9, threads: int = 0) -> float:
    """Seconds of the runtime's work per offloaded chunk update beyond its kernel calls
    (median over ``reps`` steps), the kernel on ``threads`` OpenMP threads as one rank runs it
    (0: this thread's count); 0.0 when DeepSpeed's CPU Adam is not available (the probe then
    prices the kernel alone)."""
    try:
        from ..runtime.adam import CPUAdamKernel
        kernel = _Timed(CPUAdamKernel(adamw=True, threads=threads))
        steps = _Steps(CHUNKS, kernel)
    except Exception:  # noqa: BLE001 - no compiler / no deepspeed / no memory: not measured
        return 0.0
    try:
        per_chunk = []
        for i in range(reps + 1):
            kernel.busy_s = 0.0
            t = steps.once()
            if i:                           # the first warms up
                per_chunk.append((t - kernel.busy_s) / CHUNKS)
    finally:
        steps.close()
    return max(0.0, statistics.median(per_chunk))


def measure_step_dispatch(reps: int = 9, threads: int = 0) -> float:
    """Seconds per offloaded chunk that ``step()`` spends on the training thread when the
    updates wait for the step's verdict (clipping on, no chunk speculating) and run on the host
    worker: the chunks' norms combined, each chunk's update decided and queued (median over
    ``reps`` steps). What the next forward waits for before its first kernel, on a GPU machine
    as on a CPU "device" with its worker thread; inline (no worker) it is part of
    ``measure_update_overhead``'s figure. 0.0 when DeepSpeed's CPU Adam is not available."""
    try:
        from ..runtime.adam import CPUAdamKernel
        steps = _Steps(CHUNKS, CPUAdamKernel(adamw=True, threads=threads), threaded=True)
    except Exception:  # noqa: BLE001 - no compiler / no deepspeed / no memory: not measured
        return 0.0
    try:
        per_chunk = []
        for i in range(reps + 1):
            t = steps.once()
            steps.opt.worker.drain()            # the queued updates, not timed
            if i:
                per_chunk.append(t / CHUNKS)
    finally:
        steps.close()
    return statistics.median(per_chunk)


class _Timed:
    """A host kernel that adds the time of its calls to ``busy_s``; what the runtime reads off a
    kernel (its SIMD width, padding, thread count) it reads off this one as off the kernel, so
    the step measured runs on the threads the rank's steps will."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.simd, self.pad = kernel.simd, getattr(kernel, "pad", None)
        self.threads = getattr(kernel, "threads", 0)
        self.busy_s = 0.0

    def update(self, *args, **kwargs) -> None:
        t = time.perf_counter()
        self.kernel.update(*args, **kwargs)
        self.busy_s += time.perf_counter() - t


class _Steps:
    """The runtime's ChunkOptimizer over ``n_chunks`` offloaded chunks of CHUNK_NUMEL fp32
    parameters, stepped from the state backward leaves (clipping on); ``threaded``: the updates
    on the host worker's thread (step() queues them and returns), else inline in step()."""

    def __init__(self, n_chunks: int, kernel, threaded: bool = False):
        from ..runtime.adam import AdamHyper
        from ..runtime.chunks import ChunkManager
        from ..runtime.collectives import DataParallel
        from ..runtime.optimizer import ChunkOptimizer
        from ..runtime.options import OptimizerSetup
        from ..runtime.streams import Streams

        device = torch.device("cpu")
        streams = Streams(device)
        params = [nn.Parameter(torch.zeros(CHUNK_NUMEL)) for _ in range(n_chunks)]
        # One rank whatever process group runs: only rank 0 probes while the others wait for
        # its plan, so this step must not call a collective.
        self.m = ChunkManager(named_params=[(f"p{i}", p) for i, p in enumerate(params)],
                              param_chunk=list(range(n_chunks)), chunk_parts=[(1, 1)] * n_chunks,
                              n_persist=0, n_buffer=1, chunk_capacity=CHUNK_NUMEL,
                              group_of={p: 0 for p in params}, device=device, streams=streams,
                              grad_accumulation=False, dp=DataParallel.one_rank())
        setup = OptimizerSetup(
            param_groups=[{"params": params, "lr": 1e-3}], adamw=True, clip=1.0,
            hyper=lambda g: AdamHyper(lr=g["lr"], beta1=0.9, beta2=0.999, eps=1e-8,
                                      weight_decay=0.01, bias_correction=True, adamw=True),
            speculate_chunks=0, host_thread=threaded)
        self.opt = ChunkOptimizer(self.m, streams, setup, host_kernel=kernel, device_kernel=kernel,
                                  params_in_order=params)
        self.opt.first_step_of_plan = False

    def once(self) -> float:
        from ..runtime.optimizer import StepState
        opt = self.opt
        # What backward leaves: gradients copied to the host, each chunk's norm terms taken.
        for c in self.m.chunks:
            grads = opt._host_grads(c)
            grads.fill_(1e-3)
            opt._fresh.add(c.index)
            for s in c.slots:
                s.has_grad = True
            opt._host_check(c, grads)
        opt.step_state = StepState.BACKWARD
        t = time.perf_counter()
        opt.step()
        return time.perf_counter() - t

    def close(self) -> None:
        self.opt.worker.close()
        self.m.close()

