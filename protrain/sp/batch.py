"""Sequence-sharded batches and the loss over a sequence-parallel group.

The user's data pipeline stays as it is: each rank's sampler gives it its own micro-batch.
Scheme: **gather and rotate**. The P ranks of a group gather their P micro-batches (one
all-gather of their bytes; ``BatchExchange``); the group then runs them one after another, each split over the group along the sequence (rank r holds
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

import hashlib
import inspect
import math
import pickle
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..batch_shape import batch_dims
from .ulysses import SequenceParallelError

IGNORE_INDEX = -100
_CE_PARAMS = list(inspect.signature(F.cross_entropy).parameters)
# torch renamed the tensor all-gather (all_gather_into_tensor -> all_gather_single).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def batch_shape(args, kwargs) -> tuple[int, int]:
    """(batch, sequence) of a forward call (protrain.batch_shape.batch_dims: ``input_ids``,
    ``inputs_embeds``, else the first integer tensor of two dimensions)."""
    b, s = batch_dims(args, kwargs)
    if s is None:
        raise SequenceParallelError("sequence parallelism: the forward call has no [batch, sequence] "
                                    "tensor (input_ids, inputs_embeds, integer token ids) to split")
    return b, s


def _map(args, kwargs, fn):
    return tuple(fn(a) for a in args), {k: fn(v) for k, v in kwargs.items()}


PADDING_MASK = ("sequence parallelism: the batch has a padding attention_mask, which cannot be "
                "split with the sequence. Pack sequences, or pad on the right with labels -100 "
                "and pass no attention_mask, or set protrain.sequence_parallel to 1")


def shard(args, kwargs, *, rank: int, degree: int, shift_labels: bool,
          position_ids: bool, check_mask=None) -> tuple[tuple, dict]:
    """This rank's part of one micro-batch (see the module docstring). ``check_mask(ones)``:
    takes the device's verdict on an attention_mask (a 0-d bool tensor, all ones) to check
    later without waiting for the device now; without it the mask is read at once."""
    b, s = batch_shape(args, kwargs)
    if s % degree:
        raise SequenceParallelError(f"sequence parallelism with P={degree}: the sequence length "
                                    f"{s} is not a multiple of P; pad the batch to a multiple")
    kwargs = dict(kwargs)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        ones = mask.bool().all()
        if check_mask is not None:
            check_mask(ones)
        elif not bool(ones):
            raise SequenceParallelError(PADDING_MASK)
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


_ALIGN = 16
"""Bytes each tensor of an exchanged batch is aligned to (its dtype view needs it)."""


@dataclass(frozen=True)
class _TensorSpec:
    """A tensor's place in a batch's layout: what a receiver allocates for it."""
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def room(self) -> int:
        """Bytes in the exchange buffer: rounded up so that every tensor starts aligned."""
        return -(-self.nbytes // _ALIGN) * _ALIGN


class BatchExchange:
    """Every group member's (args, kwargs) of one forward call, in group-rank order (gather
    and rotate), without pickling them every call.

    A batch's layout - its positional and keyword structure, its non-tensor values, each
    tensor's shape and dtype - rarely changes. Each call the members compare 16-byte digests
    of their layouts in one all-gather over a host-side (gloo) group: no device data read, no
    wait for the device. Only when one changed do the layouts travel as objects. The tensors
    then travel as bytes in one all-gather over the group itself, each member's padded to the
    largest. ``device``: where the group's collectives take tensors (the GPU with NCCL);
    ``to_device``: moves a host tensor there without waiting (``Streams.to_device``)."""

    def __init__(self, group, host_group, degree: int, device: torch.device, to_device=None):
        self.group, self.host_group, self.degree = group, host_group, degree
        self.device = device
        self.to_device = to_device or (lambda t: t.to(device))
        self._digests: torch.Tensor | None = None
        self._layouts: list | None = None
        self.layout_exchanges = 0
        """Calls that exchanged the layouts as objects (the rest compared digests only)."""

    def __call__(self, args, kwargs) -> list[tuple[tuple, dict]]:
        if self.degree == 1:
            return [(tuple(args), dict(kwargs))]
        mine = (tuple(args), dict(kwargs))
        leaves, layout = _layout(mine)
        digest = torch.frombuffer(bytearray(hashlib.blake2b(pickle.dumps(layout), digest_size=16).digest()),
                                  dtype=torch.int64)
        digests = torch.empty(self.degree * 2, dtype=torch.int64)
        _all_gather(digests, digest, group=self.host_group)
        if self._digests is None or not torch.equal(digests, self._digests):
            box = [None] * self.degree
            dist.all_gather_object(box, layout, group=self.host_group)
            self._digests, self._layouts = digests, box
            self.layout_exchanges += 1
        return self._tensors(leaves)

    def _tensors(self, leaves: list[torch.Tensor]) -> list[tuple[tuple, dict]]:
        """Every member's batch rebuilt from its layout and its bytes of one all-gather."""
        size = max(sum(spec.room for spec in _specs(layout)) for layout in self._layouts)
        send = torch.zeros(size, dtype=torch.uint8, device=self.device)
        at = 0
        for t in leaves:
            spec = _TensorSpec(tuple(t.shape), t.dtype)
            piece = t.detach().contiguous().reshape(-1).view(torch.uint8)
            if piece.device.type == "cpu" and self.device.type != "cpu":
                piece = self.to_device(piece)        # a blocking copy would wait for the device
            send[at:at + spec.nbytes].copy_(piece)
            at += spec.room
        got = torch.empty(self.degree * size, dtype=torch.uint8, device=self.device)
        _all_gather(got, send, group=self.group)
        home = leaves[0].device if leaves else self.device
        batches = []
        for r, layout in enumerate(self._layouts):
            at = r * size

            def tensor(spec):
                nonlocal at
                t = got[at:at + spec.nbytes].view(spec.dtype).view(spec.shape)
                at += spec.room
                return t if t.device == home else t.to(home)
            batches.append(_rebuild(layout, tensor))
        return batches


def _layout(obj):
    """(tensors in order, the structure with each tensor replaced by its _TensorSpec)."""
    leaves = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            leaves.append(x)
            return _TensorSpec(tuple(x.shape), x.dtype)
        if type(x) in (tuple, list):
            return type(x)(walk(v) for v in x)
        if type(x) is dict:
            return {k: walk(v) for k, v in x.items()}
        return x                  # travels in the layout, as it is
    return leaves, walk(obj)


def _specs(layout) -> list[_TensorSpec]:
    out = []
    _rebuild(layout, out.append)          # visits the specs in order
    return out


def _rebuild(layout, tensor):
    """The structure of ``layout`` with each _TensorSpec replaced by ``tensor(spec)``."""
    if isinstance(layout, _TensorSpec):
        return tensor(layout)
    if type(layout) in (tuple, list):
        return type(layout)(_rebuild(v, tensor) for v in layout)
    if type(layout) is dict:
        return {k: _rebuild(v, tensor) for k, v in layout.items()}
    return layout


_SHARDED_LOSS: ContextVar["ShardedLoss | None"] = ContextVar("protrain_sharded_loss", default=None)


def group_count(count: torch.Tensor) -> torch.Tensor:
    """The denominator of a mean over valid targets: ``count`` (this rank's), or under an
    active ``ShardedLoss`` the whole group's (fp64) - for a loss that sums itself and divides
    (the tiled head, protrain.runtime.tiled_head), as the mean ``ShardedLoss`` rewrites does."""
    mode = _SHARDED_LOSS.get()
    if mode is None:
        return count
    count = count.to(torch.float64)
    dist.all_reduce(count, group=mode.group)
    return count


class ShardedLoss(TorchFunctionMode):
    """While active, a mean cross-entropy is this rank's sum over the whole group's count of
    valid targets (see the module docstring)."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.calls = 0
        self._token = None

    def __enter__(self):
        self._token = _SHARDED_LOSS.set(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _SHARDED_LOSS.reset(self._token)
        return super().__exit__(*exc)

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
