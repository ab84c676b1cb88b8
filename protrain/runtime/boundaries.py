"""Part boundaries: tell when an iteration moves from one part of the model to the next.

Parts are numbered as in ModelProfile: 0 = pre (embeddings), i + 1 = block i, last = post
(head, loss). Forward boundaries come from each block's forward pre/post hooks; backward
boundaries from gradient hooks on each block's input (the part before it is entered: its
backward is done) and output (its backward starts). Both the profiler and the runtime are
driven by this one mechanism, so what is measured per part is what is scheduled per part.

Blocks are *positions* in the block list, and each is entered once per forward, in list order
(positions may be skipped: a layer dropped in this step). Two ways of calling a block more than
once are scheduled exactly:

- a module listed at several positions (weights shared across layers:
  ``nn.ModuleList([blk] * 4)``, ``[a, b, a, b]``): each call is matched to the module's next
  position after the one last entered; its parameters are then used by several parts, which
  the layout keeps resident across all of them;
- a block called again right after itself (``for _ in range(k): x = layer(x)``, ALBERT's layer
  groups): the call re-enters its own part, which spans all of its calls, forward and backward.

Any other order - a block called after a later one, e.g. ``[l0, l1]`` called l0, l1, l0, l1 -
cannot be scheduled (a block's chunks and saved activations are let go once its part is left,
and its gradients are taken when its backward is done), and is refused with ``BlockOrderError``
naming the block, once the owner marks its forwards (``begin_forward``: the runtime's and the
profiler's do). Hooks that fire during backward (a block recomputed under the user's own
checkpoint) are not boundaries: backward boundaries come from the gradient hooks alone.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Sequence

import torch
from torch import nn

OnEnter = Callable[[str, int, "torch.Tensor | None"], None]
"""on_enter(phase, part, tensor): phase "fwd" or "bwd"; ``tensor`` is the activation crossing
the boundary in forward (block input or output), None in backward."""


class BlockOrderError(RuntimeError):
    """A forward called the blocks in an order their parts cannot be scheduled in."""


def first_tensor(args, kwargs=None) -> torch.Tensor | None:
    """The hidden state a block receives or returns: its first floating-point tensor."""
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a
    return None


def block_positions(blocks: Sequence[nn.Module]) -> dict[int, list[int]]:
    """id(module) -> the positions it is listed at, ascending (several: shared weights)."""
    positions: dict[int, list[int]] = {}
    for i, b in enumerate(blocks):
        positions.setdefault(id(b), []).append(i)
    return positions


def position_names(model: nn.Module, blocks: Sequence[nn.Module]) -> list[str]:
    """Each position's qualified name in ``model``: a module listed at several positions has a
    name per listing (``transformer.h.2``), the one ending in its index where there is one."""
    names: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
    out = []
    for i, b in enumerate(blocks):
        mine = names.get(id(b)) or [f"block {i}"]
        out.append(next((n for n in mine if n.endswith(f".{i}")), mine[0]))
    return out


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class PartBoundaries:
    """The hooks' state for one model: where the forward is in the block list, and which
    boundary was reported last in each direction (a boundary between two blocks is seen from
    both sides - output of block i-1, input of block i - and reported once)."""

    def __init__(self, blocks: Sequence[nn.Module], on_enter: OnEnter, names: Sequence[str] | None = None):
        self.blocks = list(blocks)
        self.on_enter = on_enter
        self.names = list(names) if names is not None else [f"block {i}" for i in range(len(self.blocks))]
        self.n_parts = len(self.blocks) + 2
        self.positions = block_positions(self.blocks)
        self.strict = False
        """Forwards are marked (``begin_forward``): a call out of order is refused, not taken
        for the start of an unmarked forward pass."""
        self.cursor = -1
        """Position of the block entered last in this forward (-1: none yet)."""
        self.inside = False
        """Between the pre and the post hook of the block at ``cursor``."""
        self.last_fwd: int | None = None
        self.last_bwd: int | None = None

    def begin_forward(self) -> None:
        """A forward pass begins (its owner reports part 0 itself)."""
        self.strict = True
        self._restart()

    # ---- reports --------------------------------------------------------------------------
    def _fwd(self, part: int, x) -> None:
        if self.last_fwd == part:
            return
        self.last_fwd = part
        self.on_enter("fwd", part, x)

    def _bwd(self, part: int) -> None:
        if self.last_bwd == part:
            return
        self.last_bwd = part
        self.on_enter("bwd", part, None)

    # ---- hooks ------------------------------------------------------------------------------
    def pre_hook(self, module, args, kwargs):
        if _in_backward():
            return
        i = self._place(module)
        again = i == self.cursor
        self.cursor, self.inside = i, True
        x = first_tensor(args, kwargs)
        self._fwd(i + 1, x)
        # A call right after itself takes the previous call's output, whose gradient marks
        # this part's backward already (post_hook); the part before it is entered only from
        # the first call's input.
        if not again and x is not None and x.requires_grad:
            x.register_hook(lambda g, i=i: self._bwd(i))

    def post_hook(self, module, args, kwargs, out):
        if _in_backward():
            return
        i = self.cursor
        if i < 0 or self.blocks[i] is not module or not self.inside:
            if self.strict and torch.is_grad_enabled():
                raise BlockOrderError(
                    f"ProTrain: block {self._name(module)} returned while the forward was in "
                    f"{self.names[i] if i >= 0 else 'no block'}: the blocks call one another "
                    f"(nested). ProTrain schedules the blocks of one list one after the other; "
                    f"pass a list whose blocks do not call each other, or train this model "
                    f"without ProTrain")
            i = self.positions[id(module)][0] if i < 0 or self.blocks[i] is not module else i
        self.inside = False
        y = first_tensor(out if isinstance(out, (tuple, list)) else (out,))
        if i + 2 == self.n_parts - 1:
            self.last_bwd = None  # a new backward will start from the post part
        self._fwd(i + 2, y)
        if y is not None and y.requires_grad:
            y.register_hook(lambda g, i=i: self._bwd(i + 1))

    def _place(self, module) -> int:
        """The position this call of ``module`` enters: its next one after the cursor, else
        the cursor's again (called right after itself), else - out of order - refused, or in
        an unmarked or gradient-free forward taken as a new forward pass from its first."""
        ps = self.positions[id(module)]
        if (not self.strict or not torch.is_grad_enabled()) and ps[0] == 0 \
                and self.last_fwd == self.n_parts - 1:
            self._restart()          # past the last block: an unmarked forward pass begins
        nxt = next((p for p in ps if p > self.cursor), None)
        if nxt is not None:
            return nxt
        if self.cursor in ps and not self.inside:
            return self.cursor
        if self.strict and torch.is_grad_enabled():
            raise BlockOrderError(self._out_of_order(ps[0]))
        self._restart()
        return ps[0]

    def _restart(self) -> None:
        self.cursor, self.inside, self.last_fwd = -1, False, None

    def _name(self, module) -> str:
        return self.names[self.positions[id(module)][0]]

    def _out_of_order(self, p: int) -> str:
        second = ("; if this is a second forward pass of the model, run each through the engine "
                  "(engine(batch)), which marks where a forward begins" if p == 0 else "")
        return (f"ProTrain: block {self.names[p]} (position {p} of the {len(self.blocks)} blocks) "
                f"was called after block {self.names[self.cursor]} (position {self.cursor}) in "
                f"one forward pass. ProTrain runs the blocks in list order: each position once per "
                f"forward (a module listed several times, nn.ModuleList([blk] * 4), once per "
                f"listing; a block called again right after itself stays in its part); a block "
                f"called after a later one cannot be scheduled exactly (its weights, gradients and "
                f"saved activations are let go once its part is left). List the blocks in the "
                f"order the forward calls them - for layers shared in a loop, one entry per call: "
                f"nn.ModuleList([l0, l1] * k) shares their weights - or train this model without "
                f"ProTrain{second}")


@contextmanager
def part_boundaries(blocks: Sequence[nn.Module], on_enter: OnEnter, names: Sequence[str] | None = None):
    """Install the hooks for the duration of the context (one pair per distinct module, however
    often it is listed); yields the ``PartBoundaries``. ``on_enter`` is called once per
    boundary; ``names``: each position's name, for the errors."""
    bounds = PartBoundaries(blocks, on_enter, names)
    handles = []
    try:
        for ps in bounds.positions.values():
            b = bounds.blocks[ps[0]]
            handles.append(b.register_forward_pre_hook(bounds.pre_hook, with_kwargs=True))
            handles.append(b.register_forward_hook(bounds.post_hook, with_kwargs=True))
        yield bounds
    finally:
        for h in handles:
            h.remove()
