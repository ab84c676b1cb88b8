"""DeepSpeed's full-tensor accessors (``deepspeed.utils.safe_get_full_grad`` and its kin) on
a ProTrain engine's parameters: answered where ProTrain holds what DeepSpeed would return,
refused by name elsewhere, never a silent None.

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

``safe_get_full_grad`` is answered where the gradient DeepSpeed returns exists in ProTrain:
the rank's own sum of the step's micro-batches so far, before the ranks' reduction (plain
DeepSpeed's ``p.grad`` at ZeRO 0-1 between its backwards: under ``no_sync()``, with
gradient accumulation, and on one rank also after the boundary's backward), fp32, for a
parameter in a persistent chunk (on the device, where its gradients are summed), or, on one
rank with accumulation, in an offloaded chunk's accumulator; None after ``step()`` /
``zero_grad()`` as DeepSpeed. Refused by name: fp16 (DeepSpeed returns loss-scaled
gradients), several ranks at the JSON's ZeRO stage 2-3 (DeepSpeed reduces each micro-batch
there) or after the boundary's backward (DeepSpeed's all-reduced average; ProTrain reduces in
``step()``), sequence parallelism, and the cases ``ChunkOptimizer.local_gradient`` names.
"""
from __future__ import annotations

import weakref

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


class _FullGrad(_Refusal):
    """``get_full_hp_grad``: the rank's unreduced gradient where ProTrain holds it as DeepSpeed
    would return it (module docstring), else refused by name."""

    def __init__(self, engine, param: nn.Parameter):
        super().__init__("get_full_hp_grad")
        self.engine = weakref.ref(engine)
        self.param = weakref.ref(param)

    def __call__(self, *args, **kwargs):
        from protrain.runtime.optimizer import GradientNotHeld
        engine, param = self.engine(), self.param()
        runtime = getattr(engine, "protrain_runtime", None) if engine is not None else None
        if runtime is None or param is None:
            return None                      # no forward yet: no gradient, as DeepSpeed
        why = _why_not_served(engine, runtime)
        if why is None:
            try:
                return runtime.optimizer.local_gradient(param)
            except GradientNotHeld as e:
                why = str(e)
        raise NotImplementedError(
            f"deepspeed.utils.safe_get_full_grad (get_full_hp_grad) on a ProTrain engine's parameter: {why}, so "
            f"ProTrain holds no tensor equal to what DeepSpeed returns here. It answers (fp32, "
            f"bit for bit as DeepSpeed ZeRO-0) for the rank's own gradients before the ranks' "
            f"reduction: under engine.no_sync() or between accumulated micro-batches, and on one "
            f"rank after the backward too. Otherwise: engine.get_global_grad_norm() after "
            f"step() for the gradient norm, or remove the \"protrain\" section to run this "
            f"script on plain DeepSpeed")


def _why_not_served(engine, runtime) -> str | None:
    """Why DeepSpeed's answer for this engine's setup is not the rank's unreduced sum."""
    if engine.fp16_enabled():
        return "fp16 training (DeepSpeed returns gradients scaled by its loss scale)"
    plan = engine.protrain_plan
    if plan is not None and plan.knobs.sequence_parallel > 1:
        return "sequence parallelism (each rank holds its piece of the sequence's gradients)"
    world = runtime.chunks.dp.world
    if world > 1 and engine.protrain_zero_stage >= 2:
        return (f"ZeRO stage {engine.protrain_zero_stage} in the JSON on {world} ranks (DeepSpeed "
                f"reduces every micro-batch's gradients over the ranks there)")
    if world > 1 and runtime.optimizer.boundary_backward_done:
        return (f"the boundary's backward on {world} ranks (DeepSpeed has averaged the gradients "
                f"over the ranks then; ProTrain averages them in step())")
    return None


def attach(model: nn.Module, engine=None) -> None:
    """Put the accessors on every parameter of ``model``: ``get_full_hp_grad`` answering
    where it can (``engine``'s runtime), the others refusing."""
    for p in model.parameters():
        p._hp_mapping = _NotHeld()
        for name in _METHODS:
            setattr(p, name, _Refusal(name))
        if engine is not None:
            p.get_full_hp_grad = _FullGrad(engine, p)


def detach(model: nn.Module) -> None:
    """Take them off again (the engine is retired or destroyed: a later plain DeepSpeed engine
    attaches its own, or none); what another engine attached since stays."""
    ours = (_NotHeld, _Refusal, _Unmapped, _FullGrad)
    for p in model.parameters():
        for name in ("_hp_mapping", *_METHODS):
            if isinstance(vars(p).get(name), ours):
                delattr(p, name)
