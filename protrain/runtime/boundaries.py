"""Part boundaries: tell when an iteration moves from one part of the model to the next.

Parts are numbered as in ModelProfile: 0 = pre (embeddings), i + 1 = block i, last = post
(head, loss). Forward boundaries come from each block's forward pre/post hooks; backward
boundaries from gradient hooks on what each block returns (its backward starts) and, where no
block before it made such a tensor, on its input (the part before it is entered). Both the
profiler and the runtime are driven by this one mechanism, so what is measured per part is
what is scheduled per part.

A block may take and return its hidden state in any structure: a tensor, or tuples, lists,
dicts, named tuples, dataclasses and Hugging Face ModelOutputs of tensors, nested
(``tensors_in``). Its backward starts when a gradient reaches any floating-point tensor it
made and returns that requires grad; a training forward of a block that returns none, while it
has trainable parameters or gets an input that requires grad, is refused (``OutputError``):
without that hook its chunks would not be brought back for its backward, and it would train
silently wrong. In backward the parts reported only go down.

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
and its gradients are taken when its backward is done), and raises ``BlockOrderError`` naming
the block, once the owner marks its forwards (``begin_forward``: the runtime's and the
profiler's do); the DeepSpeed engine then plans with coarser blocks. Hooks that fire during
backward (a block recomputed under the user's own checkpoint) are not boundaries: backward
boundaries come from the gradient hooks alone.
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


def version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter; -1 for an inference tensor (made under
    ``torch.inference_mode``), which keeps none and cannot be changed outside that mode."""
    return -1 if t.is_inference() else t._version


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
        # By version too: a tensor changed in place since its mark (a block returning its input
        # after x.add_(...)) has another gradient node, which needs a hook of its own.
        key = (id(t), version(t))
        entry = self.parts.get(key)
        if entry is not None and entry[0]() is t:
            if part not in entry[1]:
                entry[1].append(part)
            return
        parts = [part]
        self.parts[key] = (weakref.ref(t), parts)

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
        self.active = True
        """False once the hooks are removed: gradient hooks left on tensors that outlive them
        (an input reused by later iterations) report nothing."""
        self.marks = _BackwardMarks(self._bwd)
        self.inputs: dict[int, list[tuple[torch.Tensor, int]]] = {}
        """Position -> the tensors of its call in progress, with their versions then."""
        self.returned: list[weakref.ref] = []
        """The tensors requiring grad the last block returned (its successor's hidden state)."""
        self.made_last = False
        """The last block returned a tensor of its own that took a backward mark."""

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
        if not self.active:
            return
        # Backward crosses the parts from the last down; a boundary reported above the part it
        # is in was crossed already (a block's output whose gradient completes after a tensor
        # the block made from it: that tensor's hook started the block's backward), and one
        # equal to it is its other side (or a re-entered block's earlier call).
        if self.last_bwd is not None and part >= self.last_bwd:
            return
        if self.last_bwd is None:    # this backward's first boundary: the next one starts afresh
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.last_bwd = part
        self.on_enter("bwd", part, None)

    def _end_backward(self) -> None:
        self.last_bwd = None

    # ---- hooks ------------------------------------------------------------------------------
    def pre_hook(self, module, args, kwargs):
        if _in_backward():
            return
        i = self._place(module)
        again = i == self.cursor
        self.cursor, self.inside = i, True
        ts = tensors_in((args, kwargs))
        self.inputs[i] = [(t, version(t)) for t in ts]
        # The hidden state: what the previous block returned (a tensor made earlier and handed
        # to every block, rotary tables, would report this boundary in the pre part's
        # backward), else the first input that requires grad.
        hidden = [t for t in grad_tensors(ts) if any(r() is t for r in self.returned)]
        hidden = hidden or grad_tensors(ts)[:1]
        self._fwd(i + 1, hidden[0] if hidden else first_tensor(ts))
        # Backward leaves a block where the previous block's output has its gradient (its
        # mark), not where this block's input has it: code between two blocks (a pooling, an
        # activation function, a parameter of the model's own) ran in the later block's part
        # in forward and must run its backward there too - its saved tensors are in that
        # block's stash, its parameters' chunks held for that part. The input marks it where
        # there is no such output: before the first block, or after a block that made no
        # tensor that takes a gradient. A call right after itself takes the previous call's
        # output, which marks this part already.
        if not again and not self.made_last:
            for t in hidden:
                self.marks.mark(t, i)

    def post_hook(self, module, args, kwargs, out):
        if _in_backward():
            return
        i = self.cursor
        if i < 0 or self.blocks[i] is not module or not self.inside:
            if self.strict and torch.is_grad_enabled():
                raise BlockOrderError(
                    f"ProTrain: block {self._name(module)} returned while the forward was in "
                    f"{self.names[i] if i >= 0 else 'no block'}: the blocks call one another "
                    f"(nested)")
            i = self.positions[id(module)][0] if i < 0 or self.blocks[i] is not module else i
        self.inside = False
        ts = tensors_in(out)
        grads = grad_tensors(ts)
        inputs = self.inputs.get(i, ())
        if not grads and torch.is_grad_enabled() and (
                any(t.requires_grad for t, _ in inputs) or
                any(p.requires_grad for p in module.parameters())):
            raise _refuse(i, module, out)
        # What the block made (an input it changed in place included); an input it passes
        # through is marked by its producer.
        made = [t for t in grads if not any(t is x and version(t) == v for x, v in inputs)]
        self.inputs.pop(i, None)
        self.returned = [weakref.ref(t) for t in grads]
        self.made_last = bool(made)
        if i + 2 == self.n_parts - 1:
            self.last_bwd = None  # a new backward will start from the post part
        self._fwd(i + 2, made[0] if made else first_tensor(ts))
        for t in made:
            self.marks.mark(t, i + 1)

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
        """A new forward pass (and the next backward: a model may not run its last block, whose
        post hook would say so)."""
        self.cursor, self.inside, self.last_fwd, self.last_bwd = -1, False, None, None
        self.marks.new_forward()
        self.inputs.clear()
        self.returned = []
        self.made_last = False

    def _name(self, module) -> str:
        return self.names[self.positions[id(module)][0]]

    def _out_of_order(self, p: int) -> str:
        second = (" (a second forward pass of the model inside one engine call? run each "
                  "through the engine: engine(batch) marks where a forward begins)" if p == 0 else "")
        return (f"ProTrain: block {self.names[p]} (position {p} of the {len(self.blocks)} blocks) "
                f"was called after block {self.names[self.cursor]} (position {self.cursor}) in "
                f"one forward pass{second}. Each position runs once per forward, in list order (a "
                f"module listed several times - nn.ModuleList([blk] * 4) - once per listing; a "
                f"block called again right after itself stays in its part); a block called after "
                f"a later one cannot be scheduled exactly (its weights, gradients and saved "
                f"activations are let go once its part is left). For layers shared in a loop "
                f"list one entry per call: nn.ModuleList([l0, l1] * k)")


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
        bounds.active = False
        for h in handles:
            h.remove()
