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
    kept_bytes: int = 0
    """Of ``saved_bytes``, the storages a later part saves as well (a block's output when its
    last op saves it - ReLU saves its result - and the next block saves its input). The later
    part holds them until its backward, so this part's mode cannot free them before then."""
    resaved_bytes: int = 0
    """Storages this part saves that an earlier part saved first (so they are in that part's
    ``saved_bytes``, not here): the block's input after a ReLU tail. SWAP / SSD copy them once
    more, for this block (the copies are per block), so they count in its host / disk bytes."""
    in_shared_bytes: int = 0
    """``in_bytes`` when an earlier part saved the block's input first (it is then in that
    part's ``saved_bytes`` and live until that part's backward, whatever this block's mode),
    else 0. CKPT holds the input; it costs nothing extra when it is shared."""
    attn_fwd_time: float = 0.0
    """Of ``fwd_time``: time inside the attention operator (scaled_dot_product_attention). It
    grows with s^2 where the rest grows with s; 0 when the part calls no attention."""
    attn_bwd_time: float = 0.0
    """Of ``bwd_time``: time inside the attention operator's backward."""
    attn_io_bytes: int = 0
    """Bytes of the attention operator's query, key, value and output tensors: what Ulysses'
    all-to-alls exchange per direction (before the 1/P sharding)."""
    sel_saved_bytes: int = 0
    """Bytes the selective mode (BlockMode.SELECTIVE) keeps for backward: the block input and
    the outputs of the attention operator (and, under sequence parallelism, of the all-to-alls).
    0: not measured (the block calls no attention), so the mode is not offered."""
    comm_fwd_time: float = 0.0
    """Of ``fwd_time``: all-to-all time (sequence parallelism; 0 without it). The selective mode
    does not re-run it."""
    comm_bwd_time: float = 0.0
    """Of ``bwd_time``: all-to-all time of the backward."""

    @property
    def sel_recompute_time(self) -> float:
        """Backward's extra time under the selective mode: the forward without attention and
        without the all-to-alls (whose outputs are kept)."""
        return max(self.fwd_time - self.attn_fwd_time - self.comm_fwd_time, 0.0)


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
class HeadProfile:
    """How the post part's figures change when the head and loss run over tiles of ``t``
    tokens (protrain.runtime.tiled_head), for a micro-batch of N tokens per rank: each figure
    moves by ``*_per_token`` x N (the whole logits no longer made or saved: negative) plus
    ``*_per_tile_token`` x min(t, N) (one tile's logits and their gradients). Per token, so
    the figures hold at any batch shape and sequence-parallel share. Measured from two memory
    passes at two tile lengths (protrain.measure.profiler), or derived from the shape
    (analytic profiles)."""

    saved_per_token: float
    """Change of the post's saved bytes per token."""
    fwd_peak_per_token: float
    """Change of its forward peak per token (the untiled logits' transient gone)."""
    fwd_peak_per_tile_token: float
    """Its forward peak per token of one tile."""
    bwd_start_per_token: float
    """Change of the live bytes when its backward starts, per token."""
    bwd_peak_per_token: float
    """Change of its backward peak per token."""
    bwd_peak_per_tile_token: float
    """Its backward peak per token of one tile (the recomputed tile and its gradients)."""
    bwd_time_per_token: float
    """Backward's extra time per token: each tile's logits are recomputed (one more forward
    of the head)."""
    bwd_peak_fixed: float = 0.0
    """Bytes the tiled backward adds whatever the tokens: the weight gradient summed over the
    tiles (analytic profiles; a measured profile has it inside ``bwd_peak_per_token``)."""
    held_per_token: float = 0.0
    """Change, per token, of the live bytes through the backward of every part before the post
    (the blocks', the pre's): the whole logits a training script holds with the model's output
    until its backward ends are not made (training outputs carry logits=None). Measured from
    the last block's backward start; 0 in analytic profiles (their walk holds no output)."""


@dataclass(frozen=True, slots=True)
class MLPProfile:
    """How each block's figures change when its MLP runs over tiles of ``t`` tokens
    (protrain.runtime.tiled_mlp), for a micro-batch of N tokens per rank. As HeadProfile: each
    figure moves by ``*_per_token`` x N plus ``*_per_tile_token`` x t, per block (the blocks are
    alike). Peaks here are a block's own excursions - its forward peak over its forward start,
    its backward peak over its backward start - so the walk's levels (every later part starts
    lower by what the earlier blocks no longer save) are derived, not stored. Measured from two
    memory passes at two tile lengths, or derived from the shape (analytic profiles)."""

    saved_per_token: float
    """Change of a block's saved bytes per token (the MLP's intermediates no longer saved)."""
    fwd_peak_per_token: float
    """Change of a block's forward excursion per token (the untiled MLP's transients gone)."""
    fwd_peak_per_tile_token: float
    """Its forward excursion per token of one tile (one tile's intermediates)."""
    bwd_peak_per_token: float
    """Change of a block's backward excursion per token."""
    bwd_peak_per_tile_token: float
    """Its backward excursion per token of one tile (the recomputed tile and its gradients)."""
    bwd_time_per_token: float
    """Backward's extra time per token: the MLP's forward again, tile by tile."""
    bwd_peak_fixed: float = 0.0
    """Bytes the tiled backward adds whatever the tokens: the MLP's weight gradients, their sums
    over the tiles (fp32 for 16-bit weights) and one tile's (analytic profiles; a measured
    profile has them inside ``bwd_peak_per_token``, at the profiled length)."""
    with_norm: bool = False
    """Whether the MLP's pre-norm runs inside the tiles too (protrain.runtime.tiled_mlp's
    ``with_norm``; checked on the model by the profiler): the figures are for that."""
    shortest_tile: float = 0.0
    """Of the micro-batch's tokens, the shortest tile the figures hold for (a fraction): a
    shorter tile is priced as this long. The measured passes' shorter tile: below it another
    transient of the block (attention's) may be the larger, which two passes cannot place."""


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
    heads: int = 0
    """Attention (query) heads seen by the attention operator; 0: unknown or no attention."""
    kv_heads: int = 0
    """Key/value heads seen by the attention operator (GQA when below ``heads``)."""
    sequence_parallel: int = 1
    """The sequence-parallel degree the figures are per rank for (1: as measured on one rank;
    more: derived by protrain.sp.scaling)."""
    inplace_blocks: tuple[str, ...] = ()
    """Blocks that changed an input in place in forward (``x.add_(...)`` on what they were
    given): a recompute would run from the changed input, so none of the model's blocks is
    checkpointed (CKPT or SELECTIVE)."""
    head: HeadProfile | None = None
    """The post part with its head and loss tiled (``HeadProfile``); None where the model's
    head cannot be tiled (``head_unsupported`` says why) or was not measured."""
    head_unsupported: str = ""
    """Why the head cannot be tiled (empty: it can, or it was not asked)."""
    head_tile: int = 0
    """Tokens per tile of the head these figures are for (``with_head_tile``); 0: the
    model's own head, as measured."""
    mlp: MLPProfile | None = None
    """The blocks with their MLPs tiled (``MLPProfile``); None where the MLPs cannot be tiled
    (``mlp_unsupported`` says why) or were not measured."""
    mlp_unsupported: str = ""
    """Why the blocks' MLPs cannot be tiled (empty: they can, or it was not asked)."""
    mlp_tile: int = 0
    """Tokens per tile of the blocks' MLPs these figures are for (``with_mlp_tile``); 0: the
    model's own MLPs, as measured."""

    @property
    def tokens(self) -> int | None:
        """Tokens of one micro-batch per rank (None where the batch shape is unknown)."""
        if not self.micro_batch or not self.seq_len:
            return None
        return -(-self.micro_batch * self.seq_len // self.sequence_parallel)

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

    @property
    def has_selective(self) -> bool:
        """Whether every block's selective-mode bytes were measured (the mode can be planned)."""
        return self.n_blocks > 0 and all(b.sel_saved_bytes > 0 for b in self.blocks)

    def describe(self) -> str:
        sp = f", per rank of {self.sequence_parallel} (sequence parallel)" if self.sequence_parallel > 1 else ""
        return (f"{self.name}: {self.n_blocks} blocks, {fmt_count(self.total_params)} params "
                f"({self.param_bytes}-byte), micro-batch {self.micro_batch}, seq {self.seq_len}{sp}, "
                + (f"{self.source} on {self.device}" if self.source == "measured" else self.source))


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
