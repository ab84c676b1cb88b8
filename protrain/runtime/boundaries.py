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


class BlockOrderError(RuntimeError):
    """The blocks did not run in the list's order, each once per forward pass: the parts'
    chunks and activations would be released or declared done before their last use.
    ``what``: what ran out of order; the message adds the fix."""

    def __init__(self, what: str):
        super().__init__(f"{what}; {BLOCK_ORDER_FIX}")
        self.what = what


BLOCK_ORDER_FIX = ("a block that runs twice in one forward (weights shared across layers, a layer "
                   "applied in a loop) or out of the list's order cannot be planned per block: name "
                   "a list whose blocks run once each, in order, with protrain.blocks, or leave "
                   "protrain.blocks out (ProTrain then plans coarser blocks, or none)")


class PartOrder:
    """Checks that one iteration enters the parts in order: upward in forward (a new forward
    starts at part 0), then downward in backward. ``names``: each part's name for the error."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self.fwd = 0
        self.bwd: int | None = None

    def forward(self, part: int) -> None:
        if part == 0:
            self.fwd = 0
        elif part < self.fwd:
            raise BlockOrderError(f"ProTrain: {self.names[part]} ran in forward after the forward "
                                  f"had reached {self.names[self.fwd]}, later in the block list")
        self.fwd = part
        self.bwd = None

    def backward(self, part: int) -> None:
        if self.bwd is not None and part > self.bwd:
            raise BlockOrderError(f"ProTrain: the backward of {self.names[part]} ran after the "
                                  f"backward had reached {self.names[self.bwd]}, earlier in the block "
                                  f"list (or two forwards ran before one backward)")
        self.bwd = part


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
    hooked = [False] * len(blocks)     # block i's output took a backward hook in this forward

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
                # A new forward pass, and the next backward one: the last block's post hook
                # says so too, but a model may not run its last block (an unused module).
                last_fwd[0] = last_bwd[0] = None
                hooked[:] = [False] * len(hooked)
            fwd(i + 1, x)
            # Backward leaves a block where the previous block's output has its gradient (the
            # post hook), not where this block's input has it: code between two blocks (a
            # pooling, an activation function, a parameter of the model's own) ran in the
            # later block's part in forward and must run its backward there too - its saved
            # tensors are in that block's stash, its parameters' chunks held for that part.
            # The input marks it where there is no such output: before the first block, or
            # after a block whose output had no tensor that takes a gradient.
            if (i == 0 or not hooked[i - 1]) and x is not None and x.requires_grad:
                x.register_hook(lambda g: bwd(i))
        return hook

    def post_hook(i):
        def hook(module, args, kwargs, out):
            y = first_tensor(out if isinstance(out, (tuple, list)) else (out,))
            hooked[i] = y is not None and y.requires_grad
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
