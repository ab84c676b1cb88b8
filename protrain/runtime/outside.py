"""Forwards that do not come through the framework's engine call.

Scripts call the model directly: ``model.generate(...)`` for samples during training (its loop
calls the model's own forward, not the engine's), ``engine.module(x)``, a PEFT model's
``generate`` (which calls the model it wraps). The runtime's schedule starts in
``ProTrainRuntime.forward_context``, which the engine enters; without it the parameters of
offloaded chunks are not on the device (an offloaded embedding is an empty tensor) and the
forward fails - or, worse, reads stale values.

So every module on the path from the model's root to its block list (the root, a wrapper's
inner models: PeftModel -> LoraModel -> LlamaForCausalLM -> LlamaModel) gets a forward
pre-hook: when such a module starts a forward outside any forward context, the context is
entered there and left when that module's forward ends (``always_call``: on an error too).
Inside the engine's own context they do nothing. A submodule below the block list called on
its own (one block, the head alone) is not covered: those run only inside a model's forward in
practice.
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import Callable, ContextManager, Sequence

from torch import nn


def path_to_blocks(model: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules from ``model`` down to (not including) the container of ``blocks``, the
    containers themselves left out (a ModuleList has no forward)."""
    if not blocks:
        return [model]
    names = {id(m): n for n, m in model.named_modules()}
    first = names.get(id(blocks[0]))
    if first is None:
        return [model]
    modules = dict(model.named_modules())
    parts = first.split(".")[:-1]
    path = [model]
    for i in range(1, len(parts) + 1):
        m = modules.get(".".join(parts[:i]))
        if m is not None and not isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.ParameterList)):
            path.append(m)
    return path


class OutsideForwards:
    """Enters ``forward_context`` (inside ``around()``, the adapter's, when given) for a forward
    of a module on the path to the blocks that starts outside one (``inside()`` tells whether
    a context is open)."""

    def __init__(self, path: Sequence[nn.Module], forward_context: Callable[[], ContextManager],
                 inside: Callable[[], bool], around: Callable[[], ContextManager] | None = None):
        self._forward_context = forward_context
        self._around = around
        self._inside = inside
        self._open: tuple[ExitStack, nn.Module] | None = None
        self._handles = []
        for m in path:
            self._handles.append(m.register_forward_pre_hook(self._begin))
            self._handles.append(m.register_forward_hook(self._end, always_call=True))

    def _begin(self, module, args) -> None:
        if self._open is None and not self._inside():
            stack = ExitStack()
            try:
                if self._around is not None:
                    stack.enter_context(self._around())
                stack.enter_context(self._forward_context())
            except BaseException:
                stack.close()
                raise
            self._open = (stack, module)

    def _end(self, module, args, out) -> None:
        if self._open is not None and self._open[1] is module:
            stack, _ = self._open
            self._open = None
            stack.close()

    def remove(self) -> None:
        if self._open is not None:
            stack, _ = self._open
            self._open = None
            stack.close()
        for h in self._handles:
            h.remove()
        self._handles = []
