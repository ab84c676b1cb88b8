"""Which parameters train: the guard that keeps chunk membership equal to ``requires_grad``.

A runtime's chunks hold the parameters that trained when it was built (its plan's), and Adam
steps every one of them at every step (on zeros where no gradient came). A script that
changes ``requires_grad`` later - staged fine-tuning: embeddings or lower blocks frozen for
some steps, then unfrozen; or frozen later - would otherwise be trained silently wrong: a
parameter frozen since stays in its chunk and goes on moving (stepped on zeros with
momentum), one unfrozen since is outside every chunk and is never updated.

``TrainableWatch`` takes the flags of the model's parameters when the runtime is built and
compares them at every training forward and backward: a tuple of booleans, host-side, no
device work. An adapter moves to a layout built for the new set before the forward
(ProTrainEngine re-plans, protrain_ds/trainable.py); the runtime itself refuses a training
forward or a backward under a stale layout, naming the parameters.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, slots=True)
class TrainableChange:
    """What changed in ``requires_grad`` since a runtime's chunks were built."""

    frozen: tuple[str, ...]
    """Trained when the chunks were built, ``requires_grad=False`` now."""
    unfrozen: tuple[str, ...]
    """Frozen when the chunks were built, ``requires_grad=True`` now."""

    def describe(self, limit: int = 3) -> str:
        """One line naming the parameters (the first ``limit`` of each kind and how many)."""
        parts = []
        for what, names in (("frozen", self.frozen), ("unfrozen", self.unfrozen)):
            if names:
                more = f" and {len(names) - limit} more" if len(names) > limit else ""
                parts.append(f"{what} {list(names[:limit])}{more}")
        return "; ".join(parts)


class TrainableWatch:
    """The ``requires_grad`` flags of a model's parameters (``named_parameters`` order, tied
    ones once) as they were when the chunks were built, and what differs now."""

    def __init__(self, model: nn.Module):
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.built = self.flags()

    def flags(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self.params)

    def change(self) -> TrainableChange | None:
        """None while the flags are as built; else which parameters were frozen and unfrozen."""
        now = self.flags()
        if now == self.built:
            return None
        return TrainableChange(
            frozen=tuple(n for n, a, b in zip(self.names, self.built, now) if a and not b),
            unfrozen=tuple(n for n, a, b in zip(self.names, self.built, now) if b and not a))

    def check(self, where: str) -> None:
        """Refuse ``where`` (a training forward, a backward) under chunks built for another
        trainable set."""
        change = self.change()
        if change is None:
            return
        raise RuntimeError(
            f"ProTrain: requires_grad changed since the chunks were built ({change.describe()}) "
            f"and {where} would train the old set: parameters frozen since would go on moving "
            f"and those unfrozen since would never be updated. Change requires_grad between "
            f"optimizer steps (after step(), before the next forward), where the engine moves "
            f"every state into chunks built for the new set")


def signature(flags: tuple[bool, ...]) -> int:
    """A 56-bit digest of a trainable set, equal on every rank for the same flags (to compare
    the ranks' sets inside a collective the forward makes anyway)."""
    return int.from_bytes(hashlib.blake2b(bytes(flags), digest_size=7).digest(), "little")
