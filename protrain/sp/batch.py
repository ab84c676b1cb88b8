"""Sequence-sharded batches and the loss over a sequence-parallel group.

The user's data pipeline stays as it is: each rank's sampler gives it its own micro-batch.
Scheme: **gather and rotate**. The P ranks of a group gather their P micro-batches; the group
then runs them one after another, each split over the group along the sequence (rank r holds
tokens [r s/P, (r + 1) s/P)). So the global batch and its samples are exactly the user's, each
rank computes on 1/P of a sequence at a time (its activations shrink by P), and a rank's
forward returns the loss of its own micro-batch. Per rank the compute of an optimizer step is
unchanged; the P sub-steps are gradient-accumulation micro-steps for the runtime.

Splitting one micro-batch (``shard``):
- every tensor whose first two dimensions are (batch, sequence) is cut along the sequence;
- Hugging Face causal-LM ``labels`` are shifted first (the target of token t is label t + 1,
  the last position gets -100) and passed as ``shift_labels``, so the model does not shift
  again inside a shard (shifting after slicing loses one target per shard boundary and
  mispairs the rest - DeepSpeed's autosp pass did that);
- ``position_ids`` stay global (rank r's positions start at r s/P), created when absent;
- an all-ones ``attention_mask`` is dropped (attention is causal over the whole sequence);
  a padding mask cannot be split and is refused.

The loss (``ShardedLoss``): a mean cross-entropy over a shard would weight each rank's tokens
by its own count of valid (not ignore_index) targets, and a mean of per-rank means is wrong
when the counts differ. Inside the forward, ``F.cross_entropy(reduction="mean")`` becomes
this rank's sum over the group's count of valid targets (an all-reduce of the counts), so the
sum over the group is the micro-batch's mean loss and the gradients add up to its gradient.
``reduction="sum"`` (Hugging Face with num_items_in_batch) is already right.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .ulysses import SequenceParallelError

IGNORE_INDEX = -100
_CE_PARAMS = list(inspect.signature(F.cross_entropy).parameters)


def batch_shape(args, kwargs) -> tuple[int, int]:
    """(batch, sequence) of a forward call: ``input_ids``, else the first integer tensor of
    two or more dimensions, else the first such tensor."""
    tensors = [kwargs.get("input_ids")] + list(args) + list(kwargs.values())
    tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.dim() >= 2]
    ints = [t for t in tensors if not t.is_floating_point()]
    if not tensors:
        raise SequenceParallelError("sequence parallelism: the forward call has no [batch, sequence] "
                                    "tensor (input_ids) to split")
    t = (ints or tensors)[0]
    return int(t.shape[0]), int(t.shape[1])


def _map(args, kwargs, fn):
    return tuple(fn(a) for a in args), {k: fn(v) for k, v in kwargs.items()}


def shard(args, kwargs, *, rank: int, degree: int, shift_labels: bool,
          position_ids: bool) -> tuple[tuple, dict]:
    """This rank's part of one micro-batch (see the module docstring)."""
    b, s = batch_shape(args, kwargs)
    if s % degree:
        raise SequenceParallelError(f"sequence parallelism with P={degree}: the sequence length "
                                    f"{s} is not a multiple of P; pad the batch to a multiple")
    kwargs = dict(kwargs)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        if not bool(mask.bool().all()):
            raise SequenceParallelError(
                "sequence parallelism: the batch has a padding attention_mask, which cannot be "
                "split with the sequence. Pack sequences, or pad on the right with labels -100 "
                "and pass no attention_mask, or set protrain.sequence_parallel to 1")
        kwargs.pop("attention_mask")
    device = next((t.device for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)),
                  None)
    if shift_labels and isinstance(kwargs.get("labels"), torch.Tensor) and "shift_labels" not in kwargs:
        labels = kwargs["labels"]
        shifted = torch.cat([labels[:, 1:], labels.new_full((b, 1), IGNORE_INDEX)], dim=1)
        kwargs["labels"] = kwargs["shift_labels"] = shifted
    if position_ids and kwargs.get("position_ids") is None:
        kwargs["position_ids"] = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    lo, hi = rank * s // degree, (rank + 1) * s // degree

    def cut(t):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[:2]) == (b, s):
            return t[:, lo:hi].contiguous()
        return t
    return _map(args, kwargs, cut)


def truncate(args, kwargs, seq_len: int) -> tuple[tuple, dict]:
    """The first ``seq_len`` tokens of every (batch, sequence) tensor: a shorter batch of the
    same shape family, to profile when the full sequence does not fit."""
    b, s = batch_shape(args, kwargs)

    def cut(t):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[:2]) == (b, s):
            return t[:, :seq_len].contiguous()
        return t
    return _map(args, kwargs, cut)


def gather(args, kwargs, group, degree: int) -> list[tuple[tuple, dict]]:
    """Every group member's (args, kwargs), in group-rank order (tensors travel on the host:
    token ids are small next to the activations they produce)."""
    if degree == 1:
        return [(tuple(args), dict(kwargs))]
    device = {}

    def to_host(t):
        if isinstance(t, torch.Tensor):
            device.setdefault("d", t.device)
            return t.detach().cpu()
        return t
    mine = _map(args, kwargs, to_host)
    box = [None] * degree
    dist.all_gather_object(box, mine, group=group)
    dev = device.get("d")

    def back(t):
        return t.to(dev) if isinstance(t, torch.Tensor) and dev is not None else t
    return [_map(a, k, back) for a, k in box]


class ShardedLoss(TorchFunctionMode):
    """While active, a mean cross-entropy is this rank's sum over the whole group's count of
    valid targets (see the module docstring)."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.cross_entropy:
            return func(*args, **kwargs)
        a = dict(zip(_CE_PARAMS, args))
        a.update(kwargs)
        if a.get("size_average") is not None or a.get("reduce") is not None:
            raise SequenceParallelError("sequence parallelism: cross_entropy with the deprecated "
                                        "size_average / reduce arguments; use reduction=")
        self.calls += 1
        reduction = a.get("reduction", "mean")
        if reduction == "sum":
            return func(**a)
        if reduction != "mean":
            raise SequenceParallelError(
                f"sequence parallelism: the model computes cross_entropy(reduction={reduction!r}) "
                f"and reduces it itself, which ProTrain cannot weight over the sequence shards; "
                f"use reduction='mean' or 'sum', or set protrain.sequence_parallel to 1")
        target = a["target"]
        ignore = a.get("ignore_index", IGNORE_INDEX)
        total = func(**dict(a, reduction="sum"))
        valid = target != ignore
        weight = a.get("weight")
        count = (weight[target[valid]].sum() if weight is not None else valid.sum()).to(torch.float64)
        dist.all_reduce(count, group=self.group)
        return total / count.to(total.dtype)


class LossProbe(TorchFunctionMode):
    """Counts cross_entropy calls (does a model compute its loss inside forward?)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.cross_entropy:
            self.calls += 1
        return func(*args, **(kwargs or {}))
