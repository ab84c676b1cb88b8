"""The plan file (``protrain.plan_file``): a saved plan reused instead of profiling and
searching again, if it was made for this run - else the run is refused saying what changed,
or, for batches longer than it covers, planned again and saved there.

Checked at initialize (``check_plan_file``: it can be read, or saved when the first plan is
made) and when read (``load_plan_file``: the same trainable parameters, blocks, dtype and
pins; the device memory it needs).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from torch import nn

from ..batch_shape import BatchShape
from ..config import ALL, ConfigError, PlannerConfig
from ..plan import Plan
from ..serde import unwritable


def check_plan_file(path: str) -> None:
    """Refuse at initialize a plan file that can be neither read nor saved (after profiling
    would be too late to say so)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"protrain.plan_file {path} is a directory; give a file path such as "
                          f"{p / 'plan.json'}")
    if p.exists():
        try:
            with open(p, "rb"):
                pass
        except OSError as e:
            raise ConfigError(f"protrain.plan_file {path}: cannot read it ({e.strerror or e}); fix its "
                              f"permissions or point plan_file at another path") from None
        return
    why = unwritable(p.parent)
    if why is not None:
        raise ConfigError(f"protrain.plan_file {path}: the plan chosen at the first forward could "
                          f"not be saved there ({why}); point plan_file at a writable directory")


def load_plan_file(path: str | None, module: nn.Module, n_blocks: int, planner: PlannerConfig,
                   target: BatchShape | None, *, verbose: bool,
                   block_sets: Sequence[Sequence[str]] = ()) -> Plan | None:
    """The plan in ``path`` if there is one and it was made for this run: the same trainable
    parameters of ``module``, ``n_blocks`` blocks and dtype (its predictions hold for nothing
    else), otherwise say what changed; and for batches up to ``target`` at least, otherwise
    None (planned again for this run's batches, and saved there). ``block_sets``: the blocks
    (qualified names) this run may plan with - the model's list, and the coarser ones taken
    where a block of it runs twice; a plan that names its blocks (Plan.blocks) must name one
    of them."""
    if not path or not Path(path).exists():
        return None
    try:
        plan = Plan.load(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"protrain.plan_file {path}: cannot read it ({e}); delete it to re-plan") from None
    if not plan.params:
        raise ConfigError(f"protrain.plan_file {path} has no parameter layout (it was made from "
                          f"an analytic profile); delete it to plan from a measured profile")
    why = _made_for_another_run(plan, module, n_blocks, planner, block_sets)
    if why is not None:
        raise ConfigError(f"protrain.plan_file {path} does not fit this run: {why}; delete it "
                          f"(or point plan_file at a new path) to re-plan")
    need = plan.prediction.peak_device_bytes * (1 + planner.memory_margin)
    if planner.device_memory and need > planner.device_memory:
        raise ConfigError(f"protrain.plan_file {path} needs {need / 2**30:.2f} GiB of device "
                          f"memory, above protrain.device_memory; delete it to re-plan")
    if plan.mlp_with_norm:
        # Whether each MLP's pre-norm feeds the MLP alone was checked on the model that made the
        # plan (the profiler runs both); the file cannot say this model's code is the same.
        if verbose:
            print(f"ProTrain: the plan in {path} runs the MLPs' norms inside their tiles, checked on "
                  f"the model that made it: profiling and planning again (saved there)", flush=True)
        return None
    # A plan without a sequence (features, images) covers micro-batches alone.
    shaped = plan.seq_len or (target is not None and target.seq_len is None)
    if target is not None and plan.micro_batch and shaped and \
            not BatchShape(plan.micro_batch, plan.seq_len).covers(target):
        if verbose:
            print(f"ProTrain: the plan in {path} was made for batches up to {plan.micro_batch} x "
                  f"{plan.seq_len}, this run's need {target}: planning again (saved there)",
                  flush=True)
        return None
    return plan


def _made_for_another_run(plan: Plan, module: nn.Module, n_blocks: int, planner: PlannerConfig,
                          block_sets: Sequence[Sequence[str]] = ()) -> str | None:
    """What differs between the run ``plan`` was made for and this one (None: nothing)."""
    named = dict(module.named_parameters())
    trainable = [n for n, p in named.items() if p.requires_grad]
    if plan.blocks is not None and block_sets:    # the blocks it was made for, by name
        if sorted(plan.blocks) in [sorted(b) for b in block_sets]:
            n_blocks = len(plan.blocks)
        elif len(plan.blocks) == n_blocks:
            return (f"it was made for the blocks {', '.join(plan.blocks[:3])}"
                    f"{', ...' if n_blocks > 3 else ''}, this model's are "
                    f"{', '.join(block_sets[0][:3])}{', ...' if n_blocks > 3 else ''}")
    why = plan.differs_from(
        n_blocks=n_blocks, micro_batch=None, seq_len=None,
        param_bytes=named[trainable[0]].element_size() if trainable else plan.param_bytes)
    if why is not None:
        return why
    why = pins_disagree(plan, planner.pins)
    if why is not None:
        return why
    for rec in plan.params:
        p = named.get(rec.name)
        if p is None or p.numel() != rec.numel:
            return (f"it was made for another model (parameter {rec.name} "
                    + ("is not in this one)" if p is None else
                       f"has {rec.numel} elements there, {p.numel()} here)"))
        if not p.requires_grad:
            return (f"parameter {rec.name} is trainable in the plan but frozen in this run "
                    f"(requires_grad=False)")
    planned = {rec.name for rec in plan.params}
    extra = [n for n in trainable if n not in planned]
    if extra:
        return f"parameters {extra[:3]} are trainable in this run but not in the plan"
    return None


def pins_disagree(plan: Plan, pins) -> str | None:
    """A knob the config pins that the saved plan set otherwise (the loaded plan would run,
    the pin silently ignored). The sequence-parallel degree is left out: a pinned degree is
    applied to a loaded plan (the adapter's launchable plan)."""
    for key, want in pins.pinned().items():
        if key == "sequence_parallel":
            continue
        have = getattr(plan.knobs, key)
        if want == ALL:
            want = plan.chunks.n_chunks
        if have != want:
            return f"it was made with {key}={have} and protrain.{key} pins {want}"
    return None
