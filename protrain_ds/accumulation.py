"""Gradient accumulation as DeepSpeed scripts drive it, and what the plan must hold for it.

ProTrain's runtime treats the backward at an accumulation boundary specially: an offloaded
chunk's gradients go to the host as the step's own (no accumulator) and CPU Adam may start its
update during that backward. That needs to know, during the backward, whether more backwards
follow before ``engine.step()``. DeepSpeed says so through ``"gradient_accumulation_steps"``,
but scripts also accumulate by hand with the setting at 1:

- ``engine.no_sync()`` around the micro-batches before the last one (DeepSpeed's docs; ZeRO
  0/1): DeepSpeed still calls every backward a boundary, and skips the all-reduce;
- ``engine.set_gradient_accumulation_boundary(False)`` before them (accelerate, Megatron-
  DeepSpeed);
- ``engine.coalesce_grad_reduction()`` (ZeRO 1-3): one block of backwards, then ``step()``;
- ``"managed_gradient_accumulation": false``: every backward accumulates and ``step()`` is the
  boundary (known at initialize).

For these the runtime needs accumulators (``grad_accumulation_steps`` > 1 in its setup and
plan), and a backward under ``no_sync`` is not a boundary for it. A script first seen doing it
after the first plan was made re-plans once, at the forward that shows it, before anything of
the step exists (``engine._protrain_accumulate_by_hand``).

ProTrain reduces each micro-batch's gradients over the ranks as they leave the device, where
DeepSpeed reduces their sum once: the same sum, rounded differently with several ranks (on
one rank the same bits).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def planned_steps(engine) -> int:
    """The accumulation the plan and runtime are built for: the JSON's steps, or 2 where the
    script accumulates with the setting at 1 (its number of micro-batches per step is not
    known; 2 prices the accumulators, which is what differs)."""
    gas = engine.gradient_accumulation_steps()
    if gas > 1:
        return gas
    return 2 if (engine.protrain_by_hand or not managed(engine)) else 1


def managed(engine) -> bool:
    """DeepSpeed's ``managed_gradient_accumulation`` (0.19.8 on; before it, always managed)."""
    fn = getattr(engine, "managed_gradient_accumulation", None)
    return True if fn is None else bool(fn())


def by_hand_now(engine) -> bool:
    """This forward starts a micro-batch that is not a boundary although the JSON's steps are
    1: inside ``no_sync()`` / ``coalesce_grad_reduction()``, or after
    ``set_gradient_accumulation_boundary(False)``."""
    return (engine.gradient_accumulation_steps() == 1 and torch.is_grad_enabled()
            and (engine.inside_no_sync_ctxt
                 or getattr(engine, "_is_gradient_accumulation_boundary", None) is False))


def is_boundary(engine) -> bool:
    """The runtime's boundary: DeepSpeed's, except inside ``no_sync()``, whose backwards
    DeepSpeed keeps on the rank and adds to the next one's (with the steps at 1 it still
    names each a boundary)."""
    return not engine.inside_no_sync_ctxt and engine.is_gradient_accumulation_boundary()


def refuse_mixed(engine) -> None:
    """Raised when ``no_sync`` (or a non-boundary micro-batch) begins after a boundary backward
    of the same step, with the steps at 1 and a runtime built without accumulators."""
    raise RuntimeError(
        "ProTrain: engine.no_sync() (or set_gradient_accumulation_boundary(False)) began after a "
        "backward outside it in the same optimizer step, with \"gradient_accumulation_steps\": 1. "
        "That backward's gradients already left the device as the step's own, and their CPU Adam "
        "updates may have started, so later micro-batches cannot be added to them. Run the "
        "micro-batches before the last one under no_sync() and the last one outside it (as "
        "DeepSpeed's docs and accelerate do), or set \"gradient_accumulation_steps\" to the "
        "micro-batches per step")


def check_no_sync(engine) -> None:
    """DeepSpeed's check at ``engine.no_sync()``, on the ZeRO stage the JSON names (DeepSpeed
    sees stage 0 under ProTrain): stages 2 and 3 refuse it there, and accelerate, reading the
    JSON, calls it only below stage 2."""
    stage = engine.protrain_zero_stage
    assert stage < 2, f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage {stage}"


@contextmanager
def coalesce_grad_reduction(engine):
    """DeepSpeed's ``engine.coalesce_grad_reduction()`` with its checks (ZeRO stage 1-3 named in
    the JSON; not under ``managed_gradient_accumulation: false``; not nested): the backwards
    inside accumulate and the ``step()`` after the block applies their sum. ProTrain reduces
    as gradients leave the device, so the block only marks its backwards as not boundaries."""
    assert managed(engine), \
        "coalesce_grad_reduction is not supported with managed_gradient_accumulation=False; " \
        "the caller already owns the accumulation boundary via step()"
    stage = engine.protrain_zero_stage
    if stage not in (1, 2, 3):
        raise NotImplementedError(f"coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage {stage}")
    assert not engine.inside_no_sync_ctxt, \
        "coalesce_grad_reduction cannot be nested inside another no_sync context"
    engine.inside_no_sync_ctxt = True
    try:
        yield
    finally:
        engine.inside_no_sync_ctxt = False
