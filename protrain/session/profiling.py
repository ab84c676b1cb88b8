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
import torch.utils._pytree as pytree
from torch import nn

from ..profile.cache import ProfileCache
from ..profile.model_profile import ModelProfile

LossOf = Callable[[object], torch.Tensor]
"""The tensor backward runs from, given the model's output, as a training step computes it
(the adapter's loss scaling and accumulation included)."""


def profile_batch(module: nn.Module, blocks, inputs, kwargs, *, shape: tuple[int | None, int | None],
                  device: torch.device, cache: ProfileCache, loss_of: LossOf, length: int | None = None,
                  progress: bool = False, head_tiling: bool = False, mlp_tiling: bool = False,
                  eager: Callable[[], ContextManager] = nullcontext) -> tuple[ModelProfile, int]:
    """The measured profile of ``module`` on the batch ``inputs``/``kwargs`` of ``shape``
    (micro-batch, sequence), and how many cross_entropy calls its forward made (sequence
    shards need the loss inside the model). ``length``: profile the first tokens only.
    ``eager()``: the context the profiled iteration runs in (compiled blocks run eagerly).
    ``head_tiling``: measure the head and loss over tiles too (``ModelProfile.head``);
    ``mlp_tiling``: the blocks' MLPs over tiles too (``ModelProfile.mlp``)."""
    from ..measure.profiler import profile_model
    from ..sp.batch import LossProbe, truncate
    micro_batch, seq = shape
    length = min(length or seq, seq) if seq else None
    where = cache.path(module, inputs, kwargs, device, length, blocks, head_tiling, mlp_tiling)
    cached = cache.load(where)
    if cached is not None:
        return cached, 1
    probe = LossProbe()
    # A first batch made under torch.inference_mode() (an evaluation before training): the
    # profiled iterations run autograd, which cannot save inference tensors; ordinary tensors
    # on the same memory can (no copy: the iteration allocates what it does from the batch).
    with torch.inference_mode(False):
        inputs, kwargs = pytree.tree_map_only(torch.Tensor, _not_inference, (tuple(inputs), dict(kwargs)))
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
                    micro_batch=micro_batch, seq_len=length, progress=progress, head_tiling=head_tiling,
                    mlp_tiling=mlp_tiling)
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


def _not_inference(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for an inference tensor an ordinary one viewing the same memory alike."""
    if not t.is_inference():
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
