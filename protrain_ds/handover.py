"""One engine at a time per model: what happens when a script builds a second engine on it.

Scripts build engines one after another on the same model: the Hugging Face Trainer's
``train()`` called twice, a hyperparameter search, a fine-tuning stage after a pre-training
stage, an evaluation engine without the section. Plain DeepSpeed ZeRO-0 just wraps the module
again: the new engine starts from the weights the last ``step()`` left, with a fresh optimizer,
and the old engine is never used again.

A ProTrain engine owns more than a reference: its runtime holds the parameters' values in its
chunks (offloaded ones in host memory, possibly sharded over the ranks), hooks every block and
parameter, and may still be running the last step's CPU Adam updates on its worker thread. Left
in place, its hooks and late updates act on the new engine's training (measured: the second
engine's losses part from plain DeepSpeed's at its second step). So before
``deepspeed.initialize`` builds any engine - ProTrain or not - on a model that shares a
parameter with a live ProTrain engine, that engine is retired: its queued host updates finish
(their values are the weights the new engine starts from, as ``step()`` had left them in
DeepSpeed), its runtime is closed (hooks removed, parameters made plain tensors again, sharded
values gathered: every rank builds the new engine, so every rank is here), and any later call
of it is refused naming the engine that took the model over.
"""
from __future__ import annotations

import weakref

from torch import nn

_LIVE: "weakref.WeakSet" = weakref.WeakSet()
"""ProTrain engines built in this process and not retired (weakly: a dropped engine goes)."""


def register(engine) -> None:
    """``engine`` now runs its model."""
    _LIVE.add(engine)


def retire_engines_of(model: nn.Module | None, by: str) -> None:
    """Retire every live ProTrain engine whose model shares a parameter with ``model`` (the one
    a new engine is about to be built on); ``by`` names the newcomer in later refusals."""
    if model is None or not _LIVE:
        return
    ids = {id(p) for p in model.parameters()}
    for engine in list(_LIVE):
        if any(id(p) in ids for p in engine.module.parameters()):
            engine.protrain_retire(by)
            _LIVE.discard(engine)


def retired_error(engine, what: str) -> RuntimeError:
    return RuntimeError(
        f"ProTrain: {what} on an engine whose model was taken over by {engine.protrain_retired_by} "
        f"(deepspeed.initialize was called again on the same model). This engine's runtime was "
        f"closed then, its last updates applied: train, save and evaluate with the newer engine "
        f"(a Hugging Face Trainer: trainer.model_wrapped after train())")
