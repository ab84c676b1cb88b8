"""Recompute with Megatron's tensor-parallel RNG streams restored.

torch's checkpoint restores the default CPU/CUDA generators, but dropout inside Megatron's
tensor-parallel regions draws from ``CudaRNGStatesTracker`` streams (``tracker.fork()``), which
have moved on by the time a layer is recomputed. Megatron's own ``CheckpointFunction`` saves
and restores the tracker's states around the recompute; this does the same through torch
checkpoint's ``context_fn``.
"""
from __future__ import annotations

from contextlib import contextmanager


def _tracker():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    return get_cuda_rng_tracker()


def tracker_context_fn():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: (forward ctx, recompute ctx)."""
    saved = {}

    @contextmanager
    def forward():
        # get_states copies the dict of state tensors; fork() replaces (never mutates) them.
        saved["states"] = _tracker().get_states()
        yield

    @contextmanager
    def recompute():
        tracker = _tracker()
        current = tracker.get_states()
        tracker.set_states(saved["states"])
        try:
            yield
        finally:
            tracker.set_states(current)

    return forward(), recompute()
