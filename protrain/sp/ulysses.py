"""Ulysses attention applied to an unchanged model: every call of
``torch.nn.functional.scaled_dot_product_attention`` inside the transformer blocks becomes
all-to-all (sequence split -> head split), attention over the whole sequence on heads / P
heads, all-to-all back.

Inputs are [batch, heads, local sequence, head dim] as SDPA takes them (Hugging Face and most
PyTorch models call it so). Key/value heads (GQA) split the same way when kv_heads % P == 0;
when P % kv_heads == 0 each one is replicated P / kv_heads times first, so every rank holds
the one its query heads read (the replication's backward sums the gradients back).

The all-to-all is torch's functional collective with autograd
(``all_to_all_single_autograd``): its backward is the reverse all-to-all, and it is the
operator the selective block mode keeps (protrain.runtime.selective), so a recomputed block
never re-issues it. The intercepting TorchFunctionMode is entered inside each block's own
forward (``ulysses_blocks``), so a checkpointed block's recompute goes through it as well.

Why not DeepSpeed's ``DistributedAttention``: it wraps a module the model must be rewritten to
call; the core imports no framework; and its all-to-all is not the functional collective the
selective policy can keep. The arithmetic is the same (tests compare with full attention).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from ..runtime.forward_patches import ForwardPatches

_SDPA_PARAMS = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
"""F.scaled_dot_product_attention's parameters in order (a builtin: no inspectable signature)."""


class SequenceParallelError(RuntimeError):
    """The model does something Ulysses attention cannot split; the message says what to do."""


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """All-to-all of equal splits along dim 0 (differentiable)."""
    out = fc.all_to_all_single_autograd(x.reshape(-1), None, None, group)
    return fc.wait_tensor(out).view(x.shape)


def seq_to_heads(x: torch.Tensor, group, degree: int) -> torch.Tensor:
    """[b, H, s/P, d] (this rank's tokens, all heads) -> [b, H/P, s, d] (all tokens, this
    rank's heads)."""
    b, h, s, d = x.shape
    # Allocate the send buffer contiguous (gloo scrambles views allocated like a permuted one).
    send = x.reshape(b, degree, h // degree, s, d).permute(1, 0, 2, 3, 4).contiguous()
    got = _all_to_all(send, group)                       # [P (source rank), b, H/P, s/P, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // degree, degree * s, d)


def heads_to_seq(x: torch.Tensor, group, degree: int) -> torch.Tensor:
    """[b, H/P, s, d] -> [b, H, s/P, d]: the inverse of ``seq_to_heads``."""
    b, h, s, d = x.shape
    send = x.reshape(b, h, degree, s // degree, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _all_to_all(send, group)                       # [P (source head group), b, H/P, s/P, d]
    return got.permute(1, 0, 2, 3, 4).reshape(b, degree * h, s // degree, d)


class UlyssesAttention(TorchFunctionMode):
    """While active, F.scaled_dot_product_attention runs Ulysses-style over ``group``."""

    def __init__(self, group, degree: int):
        super().__init__()
        self.group = group
        self.degree = degree
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        a = dict(zip(_SDPA_PARAMS, args))
        a.update(kwargs)
        q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
        if a.get("attn_mask") is not None:
            raise SequenceParallelError(
                "sequence parallelism: the model passes an attention mask to "
                "scaled_dot_product_attention, which cannot be split with the sequence. Train "
                "without a padding mask (pack sequences, or pad on the right with labels -100 "
                "and pass no attention_mask), or set protrain.sequence_parallel to 1")
        if q.dim() != 4:
            raise SequenceParallelError(f"sequence parallelism expects attention inputs of shape "
                                        f"[batch, heads, seq, dim]; got query {tuple(q.shape)}")
        p = self.degree
        h, hk = q.shape[1], k.shape[1]
        if h % p or (hk % p and p % hk):
            raise SequenceParallelError(
                f"sequence parallelism with P={p}: attention has {h} query and {hk} key/value "
                f"heads; P must divide the query heads and kv_heads % P == 0 or P % kv_heads == 0")
        if hk < p:
            k = k.repeat_interleave(p // hk, dim=1)
            v = v.repeat_interleave(p // hk, dim=1)
        q, k, v = (seq_to_heads(t, self.group, p) for t in (q, k, v))
        if k.shape[1] != q.shape[1]:
            a["enable_gqa"] = True
        out = func(q, k, v, **a)          # this mode is off inside its own handler
        return heads_to_seq(out, self.group, p)


class UlyssesSwitch:
    """Whether the Ulysses wrappers are on. On for the runtime's life - the recompute of a
    checkpointed block in backward must run as its forward ran - except around a forward that
    does not come through the sequence-parallel engine (``model.generate``, ``engine.module(x)``:
    each rank holds the whole sequence there, and plain attention is right)."""

    def __init__(self):
        self.on = True

    @contextmanager
    def off(self):
        before, self.on = self.on, False
        try:
            yield
        finally:
            self.on = before


@contextmanager
def ulysses_blocks(blocks: Sequence[nn.Module], group, degree: int, switch: UlyssesSwitch | None = None):
    """Make the blocks' attention Ulysses attention for the duration of the context (while
    ``switch`` is on). The mode is entered inside each block's forward: checkpoint wrappers
    installed afterwards call this forward again when they recompute. Yields the modes (their
    ``calls`` count tells whether the model called SDPA at all)."""
    switch = switch or UlyssesSwitch()
    modes: list = [None] * len(blocks)
    with ForwardPatches() as patches:
        # A module listed at several positions (shared weights) is wrapped once: its one mode
        # serves each of them (a second wrapper would redistribute the heads twice).
        for b in {id(b): b for b in blocks}.values():
            mode = UlyssesAttention(group, degree)
            for i, other in enumerate(blocks):
                if other is b:
                    modes[i] = mode
            patches.replace(b, functools.partial(_with_mode, b.forward, mode, switch))
        yield modes


def _with_mode(forward, mode, switch, *args, **kwargs):
    if not switch.on:
        return forward(*args, **kwargs)
    with mode:
        return forward(*args, **kwargs)


def new_groups(world: int, degree: int, backend: str | None = None):
    """The sequence-parallel groups of consecutive ranks [g P, (g + 1) P) (every rank must
    call this: creating a group is collective), on ``backend`` (default: the world's).
    Returns (this rank's group, its rank in it)."""
    rank = dist.get_rank()
    mine = None
    for g in range(world // degree):
        ranks = list(range(g * degree, (g + 1) * degree))
        pg = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine = pg
    return mine, rank % degree
