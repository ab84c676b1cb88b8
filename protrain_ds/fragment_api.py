"""DeepSpeed's full-tensor accessors (``deepspeed.utils.safe_get_full_grad`` and its kin) on
a ProTrain engine's parameters: refused by name, never a silent None.

DeepSpeed reads a parameter's fp32 weight, optimizer state or gradient through hooks its
optimizers attach to the parameter (``_hp_mapping`` and the ``get_full_hp_*`` /
``set_full_hp_*`` methods, ``utils/mixed_precision_linkage.py``); a parameter without them gets
``None`` back (``safe_get_full_grad``), which scripts then use as a gradient (AdaLoRA's
``update_and_allocate``: ``p * None``; a norm logger's ``.norm()`` on None). ProTrain's
gradients are consumed by CPU Adam while the backward still runs (the update of the
boundary's micro-batch is applied speculatively, then committed or rolled back at
``step()``), and its fp32 weights and Adam moments live in chunks sharded over the ranks,
on the host or on NVMe: there is no tensor to hand back. So the hooks are attached here with
methods that raise, naming the call and what gives the same information.
"""
from __future__ import annotations

from torch import nn

_METHODS = ("get_full_hp_param", "get_full_hp_grad", "set_full_hp_param", "set_full_hp_grad")


class _NotHeld:
    """What ``_hp_mapping`` holds on a ProTrain parameter: nothing DeepSpeed can address."""

    def get_optim_state_keys(self):
        return []

    def __repr__(self):
        return "<ProTrain: states in chunks, not addressable by DeepSpeed>"

    def __reduce__(self):
        # A model pickled whole while the engine runs (torch.save(model)) loads without it.
        return type(None), ()


class _Refusal:
    """One accessor: calling it raises, naming the call and the way to the same information.
    An instance attribute, not a bound method: a parameter pickled with it still loads."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        name = self.name
        what = "gradient" if name.endswith("_grad") else \
            (f"optimizer state {args[0]!r}" if args else "fp32 weight")
        raise NotImplementedError(
            f"deepspeed.utils.safe_{name[:3]}_full_* ({name}) on a ProTrain engine's parameter: "
            f"ProTrain keeps no {what} DeepSpeed can address (gradients are consumed by CPU Adam "
            f"during the backward; fp32 weights and Adam moments live in chunks sharded over the "
            f"ranks). Instead: engine.get_global_grad_norm() after step() for the gradient norm, "
            f"engine.module.state_dict() (on every rank) for the weights, "
            f"engine.save_checkpoint() for every state; or remove the \"protrain\" section to "
            f"run this script on plain DeepSpeed")

    def __reduce__(self):
        # Unpickled away from the engine: DeepSpeed's answer for a parameter it maps nothing for.
        return _Unmapped, ()


class _Unmapped:
    """An accessor that answers None, as DeepSpeed's do for a parameter it maps nothing for."""

    def __call__(self, *args, **kwargs):
        return None


def attach(model: nn.Module) -> None:
    """Put the refusing accessors on every parameter of ``model``."""
    for p in model.parameters():
        p._hp_mapping = _NotHeld()
        for name in _METHODS:
            setattr(p, name, _Refusal(name))


def detach(model: nn.Module) -> None:
    """Take them off again (the engine is retired or destroyed: a later plain DeepSpeed engine
    attaches its own, or none); what another engine attached since stays."""
    ours = (_NotHeld, _Refusal, _Unmapped)
    for p in model.parameters():
        for name in ("_hp_mapping", *_METHODS):
            if isinstance(vars(p).get(name), ours):
                delattr(p, name)
