"""Long-context selective checkpointing (AutoSP): which operator outputs a SELECTIVE block keeps.

At long sequences attention costs s^2 while the projections, norms and MLP cost s, so
recomputing everything but attention is cheap next to the memory it frees. A SELECTIVE block
runs under torch's non-reentrant checkpoint with a selective-checkpoint policy
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of the
attention kernels and of the sequence-parallel all-to-alls are stored during forward and
handed back during the recompute, every other operator is recomputed. So attention never runs
twice and no collective is issued again in backward (an all-to-all re-issued during recompute
would also have to match on every rank of the group).

Framework-neutral: the DeepSpeed engine and the Megatron layer hooks apply it through
``protrain.runtime.activations.checkpointed_blocks``; the profiler counts the bytes of the
same operators' outputs (``is_kept``), so the memory model's ``sel_saved_bytes`` and the
runtime keep the same tensors.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def _ops(*names: str) -> frozenset:
    """The overloads that exist in this torch build (kernels differ between releases and
    devices; a missing one simply never runs here)."""
    found = []
    for name in names:
        ns, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, ns, None), op, None)
        if packet is not None and hasattr(packet, overload):
            found.append(getattr(packet, overload))
    return frozenset(found)


ATTENTION_OPS = _ops(
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
)
"""The fused attention kernels F.scaled_dot_product_attention dispatches to. (Its math
fallback decomposes into matmuls and softmax before any dispatch mode sees it: blocks running
it save no attention output and are not offered the mode.)"""

COLLECTIVE_OPS = _ops(
    "_c10d_functional.all_to_all_single.default",
    "_c10d_functional.wait_tensor.default",
)
"""The functional all-to-all Ulysses attention issues (protrain.sp.ulysses) and its wait."""

KEPT_OPS = ATTENTION_OPS | COLLECTIVE_OPS


def is_kept(func) -> bool:
    """Whether a SELECTIVE block keeps the outputs of operator ``func``."""
    return func in KEPT_OPS


def selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn(extra_context_fn=None):
    """``context_fn`` for torch.utils.checkpoint that applies the selective policy, combined
    with an optional other one (Megatron's tensor-parallel RNG restore, the block's buffers),
    entered outside the policy's: what it does is not replayed by the policy."""
    policy = functools.partial(create_selective_checkpoint_contexts, selective_policy)
    return combine_context_fns(extra_context_fn, policy)


def combine_context_fns(*context_fns):
    """One ``context_fn`` for torch.utils.checkpoint from several (None ones left out): each
    call makes every pair, and the contexts are entered in the order given."""
    fns = [f for f in context_fns if f is not None]
    if len(fns) <= 1:
        return fns[0] if fns else None

    def all_of():
        pairs = [f() for f in fns]
        return _stack(*(p[0] for p in pairs)), _stack(*(p[1] for p in pairs))
    return all_of


@contextlib.contextmanager
def _stack(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield
