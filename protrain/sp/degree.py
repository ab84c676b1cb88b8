"""Which Ulysses sequence-parallel degrees P a launch can run, and why the others cannot.

Ulysses (DeepSpeed-Ulysses) splits each sequence over P ranks and, around attention, trades
the split for a split of the heads with an all-to-all. So P must divide:
- the world size (ranks form groups of P; the groups are data-parallel replicas);
- the number of query heads (each rank attends with heads / P of them);
- the sequence length (each rank holds seq / P tokens outside attention);
and the key/value heads must split the same way: kv_heads % P == 0, or P % kv_heads == 0 with
each key/value head replicated P / kv_heads times (GQA with fewer KV heads than ranks).
Megatron's context parallelism (the same all-to-all, ``cp_comm_type="a2a"``) also splits each
rank's share of the sequence in two chunks for causal load balance (``seq_multiple=2``), and
its groups come out of the ranks left after tensor and pipeline parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError

SEQ_STEP = 128
"""The granule of the sequence lengths the planner names (``protrain plan --seq max``, the
"about N tokens fit" of a degree that does not fit): a multiple of 128 tokens per rank, times P
(times ``seq_multiple``), so every length named is one P divides and each rank holds a multiple
of 128 tokens - the tile of flash-attention kernels and the lengths people train at."""


@dataclass(frozen=True, slots=True)
class SPShape:
    """What the degree constraints depend on."""

    world: int
    """Ranks of the launch."""
    heads: int
    """Query heads of the attention operator (0: unknown: no attention was seen)."""
    kv_heads: int
    """Key/value heads (equal to heads without GQA)."""
    seq_len: int
    """Tokens per sequence of the training batch."""
    seq_multiple: int = 1
    """Chunks each rank's share of the sequence is split into (Megatron's load-balanced
    causal split: 2), so P x seq_multiple must divide the sequence."""
    knob: str = "P"
    """The degree's name in messages ("CP" for Megatron's context parallelism)."""
    world_label: str = ""
    """What ``world`` counts, for messages (default: "the world size (N ranks)")."""
    kv_replication: bool = True
    """Whether key/value heads may be replicated when P exceeds them (ProTrain's all-to-all
    does; Transformer Engine's needs kv_heads % P == 0)."""


def broken_constraints(degree: int, shape: SPShape) -> list[str]:
    """The constraints ``degree`` breaks, each named with the numbers involved (empty: valid)."""
    p, k = degree, shape.knob
    out = []
    if p < 1:
        return [f"{k}={p} must be at least 1"]
    if p == 1:
        return out
    if shape.world % p:
        out.append(f"{k} must divide {shape.world_label or f'the world size ({shape.world} ranks)'}")
    if shape.heads <= 0:
        out.append("the model's blocks call no attention operator ProTrain can split "
                   "(torch.nn.functional.scaled_dot_product_attention; Hugging Face models: load "
                   "with attn_implementation=\"sdpa\")")
    else:
        if shape.heads % p:
            out.append(f"{k} must divide the attention head count ({shape.heads} heads)")
        kv = shape.kv_heads or shape.heads
        if kv % p and (p % kv or not shape.kv_replication):
            out.append(f"the KV-head rule: kv_heads % {k} == 0 or {k} % kv_heads == 0 ({kv} KV heads)"
                       if shape.kv_replication else f"{k} must divide the key/value heads ({kv}) for "
                       f"Transformer Engine's all-to-all")
    m = shape.seq_multiple
    if shape.seq_len % (p * m):
        out.append(f"{k} must divide the sequence length ({shape.seq_len} tokens)" if m == 1 else
                   f"{m} x {k} must divide the sequence length ({shape.seq_len} tokens)")
    return out


def seq_step(degree: int, shape: SPShape | None = None) -> int:
    """The granule of the sequence lengths named for ``degree``: ``SEQ_STEP`` tokens per rank
    (per chunk of a rank's share, with Megatron's load-balanced split)."""
    return SEQ_STEP * max(degree, 1) * (shape.seq_multiple if shape is not None else 1)


def valid_degrees(shape: SPShape) -> tuple[int, ...]:
    """Every P that satisfies all constraints, 1 included."""
    return tuple(p for p in range(1, shape.world + 1) if not broken_constraints(p, shape))


def check_degree(degree: int, shape: SPShape, where: str = "protrain.sequence_parallel",
                 auto: str = '(or "auto")') -> None:
    """Refuse a pinned degree that breaks a constraint, naming it and the valid values
    (``auto``: how to let the planner choose instead)."""
    broken = broken_constraints(degree, shape)
    if broken:
        raise ConfigError(f"{where} = {degree}: " + "; ".join(broken) + f". Valid values here: "
                          f"{', '.join(map(str, valid_degrees(shape)))} {auto}")
