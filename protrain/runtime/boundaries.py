"""Part boundaries: tell when an iteration moves from one part of the model to the next.

Parts are numbered as in ModelProfile: 0 = pre (embeddings), i + 1 = block i, last = post
(head, loss). Forward boundaries come from each block's forward pre/post hooks; backward
boundaries from gradient hooks on each block's output (its backward starts) and input (its
backward is done). Both the profiler and the runtime are driven by this one mechanism, so
what is measured per part is what is scheduled per part.

A block may take and return its hidden state in any structure: a tensor, or tuples, lists,
dicts, named tuples, dataclasses and Hugging Face ModelOutputs of tensors, nested
(``tensors_in``). Its backward starts when a gradient reaches any floating-point tensor it
returns that requires grad; a training forward of a block that returns none, while it has
trainable parameters or gets an input that requires grad, is refused (``OutputError``):
without that hook its chunks would not be brought back for its backward, and it would train
silently wrong.
"""
from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Callable, Sequence

import torch
import torch.utils._pytree as pytree
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


class OutputError(RuntimeError):
    """A block's training forward returned no tensor its backward could be started from."""


def tensors_in(obj, _depth: int = 0) -> list[torch.Tensor]:
    """Every tensor in ``obj``, in order: torch's pytree flattens tuples, lists, dicts, named
    tuples and the Hugging Face ModelOutputs it knows; mappings and dataclasses it does not
    know (a dict subclass, a ModelOutput of a transformers that does not register it) are
    opened here."""
    found: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif _depth < 8 and isinstance(leaf, Mapping):
            found += tensors_in(list(leaf.values()), _depth + 1)
        elif _depth < 8 and dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += tensors_in([getattr(leaf, f.name) for f in dataclasses.fields(leaf)], _depth + 1)
    return found


def grad_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The floating-point tensors among ``tensors`` that require grad: the hidden state."""
    return [t for t in tensors if t.is_floating_point() and t.requires_grad]


def first_tensor(args, kwargs=None) -> torch.Tensor | None:
    """The hidden state a block receives or returns: its first floating-point tensor that
    requires grad, else its first floating-point tensor (in any structure, ``tensors_in``)."""
    ts = tensors_in((tuple(args), dict(kwargs or {})))
    for t in grad_tensors(ts) or [t for t in ts if t.is_floating_point()]:
        return t
    return None


class _BackwardMarks:
    """One gradient hook per tensor, however many boundaries it marks. A tensor can be the
    output of block i - 1 and the input of block i, and the input of block i + 1 too when
    block i passes it through: its hook reports those boundaries from the last part down, the
    order backward crosses them (hooks of their own would fire in registration order)."""

    def __init__(self, report: Callable[[int], None]):
        self.report = report
        self.parts: dict[int, tuple[weakref.ref, list[int]]] = {}

    def mark(self, t: torch.Tensor, part: int) -> None:
        entry = self.parts.get(id(t))
        if entry is not None and entry[0]() is t:
            if part not in entry[1]:
                entry[1].append(part)
            return
        parts = [part]
        self.parts[id(t)] = (weakref.ref(t), parts)

        def hook(grad, parts=parts):
            for p in sorted(parts, reverse=True):
                self.report(p)
        t.register_hook(hook)

    def new_forward(self) -> None:
        self.parts.clear()


def _refuse(i: int, module: nn.Module, out) -> OutputError:
    return OutputError(
        f"ProTrain: block {i} ({type(module).__name__}) returned {type(out).__name__} holding no "
        f"floating-point tensor that requires grad, in a training forward where the block has "
        f"trainable parameters or an input that requires grad. ProTrain starts each block's "
        f"backward from a gradient hook on the hidden state it returns (to bring its chunks back), "
        f"so it cannot train this block exactly. Return the hidden state as a tensor, or inside a "
        f"tuple, list, dict, dataclass or ModelOutput")


@contextmanager
def part_boundaries(blocks: Sequence[nn.Module], on_enter: OnEnter):
    """Install the hooks for the duration of the context. ``on_enter`` is called once per
    boundary: the boundary between two blocks is seen from both sides (output of block i-1,
    input of block i), in forward and in backward, and reported once; in backward the parts
    reported only go down."""
    n_parts = len(blocks) + 2
    last_bwd = [None]
    last_fwd = [None]
    inputs: dict[int, list[torch.Tensor]] = {}     # block -> its inputs, during its call
    returned: list[weakref.ref] = []               # what the last block returned
    hooked = [False] * len(blocks)     # block i's output took a backward mark in this forward
    active = [True]

    def end_backward():
        last_bwd[0] = None

    def bwd(part):
        if not active:       # a gradient hook on a tensor that outlived the context (an input
            return           # reused by later iterations): not ours any more
        # Backward crosses the parts from the last down; a boundary reported above the part it
        # is in was crossed already (a block's output whose gradient completes after a tensor
        # the block made from it: that tensor's hook started the block's backward).
        if last_bwd[0] is not None and part >= last_bwd[0]:
            return
        if last_bwd[0] is None:      # this backward's first boundary: the next one starts afresh
            torch.autograd.Variable._execution_engine.queue_callback(end_backward)
        last_bwd[0] = part
        on_enter("bwd", part, None)
    marks = _BackwardMarks(bwd)

    def fwd(part, x):
        if last_fwd[0] == part:
            return
        last_fwd[0] = part
        on_enter("fwd", part, x)

    def pre_hook(i):
        def hook(module, args, kwargs):
            ts = tensors_in((args, kwargs))
            inputs[i] = ts
            if i == 0:
                # A new forward pass, and the next backward one (a model may not run its last
                # block, whose post hook says so too).
                last_fwd[0] = last_bwd[0] = None
                marks.new_forward()
                hooked[:] = [False] * len(hooked)
            # The hidden state: what the previous block returned (a tensor made earlier and
            # handed to every block, rotary tables, would report this boundary in the pre
            # part's backward), else the first input that requires grad.
            hidden = [t for t in grad_tensors(ts) if any(r() is t for r in returned)] if i else []
            hidden = hidden or grad_tensors(ts)[:1]
            fwd(i + 1, hidden[0] if hidden else first_tensor(ts))
            # Backward leaves a block where the previous block's output has its gradient (its
            # mark), not where this block's input has it: code between two blocks (a pooling,
            # an activation function, a parameter of the model's own) ran in the later block's
            # part in forward and must run its backward there too - its saved tensors are in
            # that block's stash, its parameters' chunks held for that part. The input marks
            # it where there is no such output: before the first block, or after a block that
            # made no tensor that takes a gradient.
            if i == 0 or not hooked[i - 1]:
                for t in hidden:
                    marks.mark(t, i)
        return hook

    def post_hook(i):
        def hook(module, args, kwargs, out):
            ts = tensors_in(out)
            grads = grad_tensors(ts)
            if not grads and torch.is_grad_enabled() and (
                    any(t.requires_grad for t in inputs.get(i, ())) or
                    any(p.requires_grad for p in module.parameters())):
                raise _refuse(i, module, out)
            # What the block made; an input it passes through is marked by its producer.
            made = [t for t in grads if not any(t is x for x in inputs.get(i, ()))]
            inputs.pop(i, None)
            returned[:] = [weakref.ref(t) for t in grads]
            hooked[i] = bool(made)
            if i + 2 == n_parts - 1:
                last_bwd[0] = None  # a new backward will start from the post part
            fwd(i + 2, made[0] if made else first_tensor(ts))
            for t in made:
                marks.mark(t, i + 1)
        return hook

    handles = []
    try:
        for i, b in enumerate(blocks):
            handles.append(b.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
            handles.append(b.register_forward_hook(post_hook(i), with_kwargs=True))
        yield
    finally:
        active.clear()
        for h in handles:
            h.remove()
