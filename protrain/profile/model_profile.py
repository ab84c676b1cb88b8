"""ModelProfile: what one traced training iteration tells the cost models about a model.

The model is cut into *parts* in execution order: ``pre`` (everything before the first
transformer block: embeddings), one part per transformer block, and ``post`` (everything after
the last block: final norm, head, loss). Every memory figure is measured in the *keep-all*
activation mode (no checkpointing, no swapping) and counts only what the iteration itself
allocates on the device: model states (parameters, gradients, optimizer states) are excluded
and modelled from the chunk layout instead, so one profile serves every plan.

All memory figures are bytes, relative to the live bytes at the start of the iteration; all
times are seconds, already rescaled to un-hooked speed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..serde import JsonValue
from ..units import fmt_count

PartKind = Literal["pre", "block", "post"]


@dataclass(frozen=True, slots=True)
class ParamRecord:
    """One parameter, in order of first use in forward."""

    name: str
    """Qualified name in the model (``transformer.h.3.attn.c_attn.weight``)."""
    numel: int
    """Number of elements."""
    parts: tuple[int, ...]
    """Indices of the parts that use it, first use first. More than one means the parameter is
    shared (tied embeddings); its home, and so its chunk, is the first."""


@dataclass(frozen=True, slots=True)
class PartProfile:
    """Measured facts about one part (pre, one block, post) in keep-all mode."""

    name: str
    """Module path of the block, or ``<pre>`` / ``<post>``."""
    kind: PartKind
    """pre, block or post. Only blocks get an activation mode; pre and post always keep all."""
    param_numel: int
    """Elements of the parameters whose home is this part."""
    fwd_time: float
    """Forward compute time of the part."""
    bwd_time: float
    """Backward compute time of the part (keep-all, so without recompute)."""
    in_bytes: int
    """Bytes of the activation flowing into the part (the block input). CKPT keeps exactly this."""
    saved_bytes: int
    """Bytes of the distinct storages autograd saved for backward during this part's forward,
    excluding parameters (and views of them) and tensors that existed before the iteration.
    A storage saved by several parts belongs to the first. This is what SWAP moves off the
    device and what CKPT drops."""
    fwd_start: int
    """Live activation bytes when the part's forward starts."""
    fwd_peak: int
    """Highest live activation bytes during the part's forward, intra-op transients included."""
    bwd_start: int
    """Live activation bytes when the part's backward starts."""
    bwd_peak: int
    """Highest live activation bytes during the part's backward."""


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One device operator of the memory pass (recorded on CUDA, where the allocator can say
    what happens inside an op)."""

    name: str
    part: int
    phase: Literal["fwd", "bwd"]
    live_before: int
    """Live bytes just before the op."""
    intra_peak: int
    """Peak above ``live_before`` reached inside the op (workspaces, temporaries)."""
    inter_delta: int
    """Bytes allocated (or freed, negative) between the previous op's end and this op's start
    by code the hooks do not see (functional calls, extensions, collectives)."""


@dataclass(frozen=True, slots=True)
class ModelProfile(JsonValue):
    """Everything the cost models need to know about the model and its batch."""

    name: str
    """What was profiled (class name or preset name)."""
    source: Literal["measured", "analytic"]
    """``measured``: one traced iteration on the real device. ``analytic``: derived from the
    model's shape and the hardware's published peaks, an estimate for planning ahead."""
    device: str
    """Device the profile was measured on (``cuda:0``, ``cpu``) or ``analytic``."""
    param_bytes: int
    """Bytes per element of the parameters as trained (2 for bf16/fp16, 4 for fp32)."""
    params: tuple[ParamRecord, ...]
    """All trainable parameters in execution order."""
    parts: tuple[PartProfile, ...]
    """pre, blocks in order, post."""
    micro_batch: int | None = None
    """Samples per micro-batch, when known (used to suggest a micro-batch that fits)."""
    seq_len: int | None = None
    """Sequence length, when known."""
    hooked_slowdown: float = 1.0
    """Hooked iteration time over plain iteration time; part times are already divided by it."""
    ops: tuple[OpRecord, ...] = field(default=())
    """Per-operator memory records (CUDA only; empty elsewhere)."""

    # ---- derived views -------------------------------------------------------------------
    @property
    def blocks(self) -> tuple[PartProfile, ...]:
        return tuple(p for p in self.parts if p.kind == "block")

    @property
    def n_blocks(self) -> int:
        return sum(1 for p in self.parts if p.kind == "block")

    @property
    def block_part_indices(self) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.parts) if p.kind == "block")

    @property
    def total_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def largest_param(self) -> int:
        return max((p.numel for p in self.params), default=0)

    def activation_peak_keep_all(self) -> int:
        """Highest live activation bytes of the traced iteration itself."""
        return max([p.fwd_peak for p in self.parts] + [p.bwd_peak for p in self.parts] + [0])

    def describe(self) -> str:
        return (f"{self.name}: {self.n_blocks} blocks, {fmt_count(self.total_params)} params "
                f"({self.param_bytes}-byte), micro-batch {self.micro_batch}, seq {self.seq_len}, "
                f"{self.source} on {self.device}")


    def __post_init__(self) -> None:
        kinds = [p.kind for p in self.parts]
        if not kinds or kinds[0] != "pre" or kinds[-1] != "post" or "pre" in kinds[1:] or \
                "post" in kinds[:-1]:
            raise ValueError(f"ModelProfile.parts must be pre, blocks..., post; got {kinds}")
        if self.param_bytes not in (1, 2, 4, 8):
            raise ValueError(f"ModelProfile.param_bytes must be 1, 2, 4 or 8, got {self.param_bytes}")
        for rec in self.params:
            if not rec.parts or not all(0 <= i < len(self.parts) for i in rec.parts):
                raise ValueError(f"parameter {rec.name} names parts {rec.parts} outside 0..{len(self.parts) - 1}")
