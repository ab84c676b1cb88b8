"""ForwardPatches: modules' forwards replaced for a while (checkpoint wrappers, compiled
forwards, Ulysses attention, tiled MLPs), and given back exactly as they were."""
from __future__ import annotations

from typing import Callable

from torch import nn


class ForwardPatches:
    """Forwards replaced on modules, given back in reverse order by ``restore`` (or on leaving
    the context): a module's own ``forward`` attribute where it had one, else its class's (the
    instance attribute removed, so the module is as it was built)."""

    def __init__(self):
        self._saved: list[tuple[nn.Module, Callable | None]] = []

    def replace(self, module: nn.Module, forward: Callable) -> None:
        self._saved.append((module, module.__dict__.get("forward")))     # None: the class's forward
        module.forward = forward

    def restore(self) -> None:
        for module, own in reversed(self._saved):
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own
        self._saved = []

    def __enter__(self) -> ForwardPatches:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


__all__ = ["ForwardPatches"]
