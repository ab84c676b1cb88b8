"""Part boundaries: tell when an iteration moves from one part of the model to the next.

Parts are numbered as in ModelProfile: 0 = pre (embeddings), i + 1 = block i, last = post
(head, loss). Forward boundaries come from each block's forward pre/post hooks; backward
boundaries from gradient hooks on each block's output (its backward starts) and input (its
backward is done). Both the profiler and the runtime are driven by this one mechanism, so
what is measured per part is what is scheduled per part.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Sequence

import torch
from torch import nn

OnEnter = Callable[[str, int, "torch.Tensor | None"], None]
"""on_enter(phase, part, tensor): phase "fwd" or "bwd"; ``tensor`` is the activation crossing
the boundary in forward (block input or output), None in backward."""


def first_tensor(args, kwargs=None) -> torch.Tensor | None:
    """The hidden state a block receives or returns: its first floating-point tensor."""
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a
    return None


@contextmanager
def part_boundaries(blocks: Sequence[nn.Module], on_enter: OnEnter):
    """Install the hooks for the duration of the context. ``on_enter`` is called once per
    boundary: the boundary between two blocks is seen from both sides (output of block i-1,
    input of block i), in forward and in backward, and reported once."""
    n_parts = len(blocks) + 2
    last_bwd = [None]
    last_fwd = [None]

    def bwd(part):
        if last_bwd[0] == part:
            return
        last_bwd[0] = part
        on_enter("bwd", part, None)

    def fwd(part, x):
        if last_fwd[0] == part:
            return
        last_fwd[0] = part
        on_enter("fwd", part, x)

    def pre_hook(i):
        def hook(module, args, kwargs):
            x = first_tensor(args, kwargs)
            if i == 0:
                last_fwd[0] = None   # a new forward pass
            fwd(i + 1, x)
            if x is not None and x.requires_grad:
                x.register_hook(lambda g: bwd(i))
        return hook

    def post_hook(i):
        def hook(module, args, kwargs, out):
            y = first_tensor(out if isinstance(out, (tuple, list)) else (out,))
            if i + 2 == n_parts - 1:
                last_bwd[0] = None  # a new backward will start from the post part
            fwd(i + 2, y)
            if y is not None and y.requires_grad:
                y.register_hook(lambda g: bwd(i + 1))
        return hook

    handles = []
    try:
        for i, b in enumerate(blocks):
            handles.append(b.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
            handles.append(b.register_forward_hook(post_hook(i), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
