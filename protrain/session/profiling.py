"""Profiling the user's first batch for the plan: one traced training iteration of the model,
taken from the profile cache when the same model and batch were measured before.

At ``length`` (the session's ``profile_seq_len``) only the batch's first tokens are profiled,
and protrain.sp.scaling rescales the profile to the full sequence; a sequence that runs out of
device memory while profiling is halved until it fits (down to 128 tokens).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

import torch
from torch import nn

from ..profile.cache import ProfileCache
from ..profile.model_profile import ModelProfile

LossOf = Callable[[object], torch.Tensor]
"""The tensor backward runs from, given the model's output, as a training step computes it
(the adapter's loss scaling and accumulation included)."""


def profile_batch(module: nn.Module, blocks, inputs, kwargs, *, shape: tuple[int | None, int | None],
                  device: torch.device, cache: ProfileCache, loss_of: LossOf, length: int | None = None,
                  progress: bool = False,
                  eager: Callable[[], ContextManager] = nullcontext) -> tuple[ModelProfile, int]:
    """The measured profile of ``module`` on the batch ``inputs``/``kwargs`` of ``shape``
    (micro-batch, sequence), and how many cross_entropy calls its forward made (sequence
    shards need the loss inside the model). ``length``: profile the first tokens only.
    ``eager()``: the context the profiled iteration runs in (compiled blocks run eagerly)."""
    from ..measure.profiler import profile_model
    from ..sp.batch import LossProbe, truncate
    micro_batch, seq = shape
    length = min(length or seq, seq) if seq else None
    where = cache.path(module, inputs, kwargs, device, length, blocks)
    cached = cache.load(where)
    if cached is not None:
        return cached, 1
    probe = LossProbe()
    while True:
        a, k = truncate(inputs, kwargs, length) if length and length != seq else (inputs, kwargs)
        held = []

        def step(m):
            # What a training step does with the output: the script keeps it (logits
            # included) through backward, the adapter scales the loss; so the profiled
            # iteration allocates what a training iteration does.
            with probe:
                held[:] = [m(*a, **k)]
            return loss_of(held[0])

        try:
            with eager():
                profile = profile_model(
                    module, step, blocks=blocks, device=device, name=type(module).__name__,
                    micro_batch=micro_batch, seq_len=length, progress=progress)
            break
        except torch.OutOfMemoryError:
            held.clear()
            if not length or length < 256:
                raise
            length //= 2
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"ProTrain: profiling at sequence {length * 2} ran out of device memory; "
                  f"profiling at {length} and scaling to {seq}", flush=True)
    held.clear()
    cache.save(where, profile)
    return profile, probe.calls
