"""Which Ulysses sequence-parallel degrees P a launch can run, and why the others cannot.

Ulysses (DeepSpeed-Ulysses) splits each sequence over P ranks and, around attention, trades
the split for a split of the heads with an all-to-all. So P must divide:
- the world size (ranks form groups of P; the groups are data-parallel replicas);
- the number of query heads (each rank attends with heads / P of them);
- the sequence length (each rank holds seq / P tokens outside attention);
and the key/value heads must split the same way: kv_heads % P == 0, or P % kv_heads == 0 with
each key/value head replicated P / kv_heads times (GQA with fewer KV heads than ranks).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError


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


def broken_constraints(degree: int, shape: SPShape) -> list[str]:
    """The constraints ``degree`` breaks, each named with the numbers involved (empty: valid)."""
    p = degree
    out = []
    if p < 1:
        return [f"P={p} must be at least 1"]
    if p == 1:
        return out
    if shape.world % p:
        out.append(f"P must divide the world size ({shape.world} ranks)")
    if shape.heads <= 0:
        out.append("the model's blocks call no attention operator ProTrain can split "
                   "(torch.nn.functional.scaled_dot_product_attention; Hugging Face models: load "
                   "with attn_implementation=\"sdpa\")")
    else:
        if shape.heads % p:
            out.append(f"P must divide the attention head count ({shape.heads} heads)")
        kv = shape.kv_heads or shape.heads
        if kv % p and p % kv:
            out.append(f"the KV-head rule: kv_heads % P == 0 or P % kv_heads == 0 ({kv} KV heads)")
    if shape.seq_len % p:
        out.append(f"P must divide the sequence length ({shape.seq_len} tokens)")
    return out


def valid_degrees(shape: SPShape) -> tuple[int, ...]:
    """Every P that satisfies all constraints, 1 included."""
    return tuple(p for p in range(1, shape.world + 1) if not broken_constraints(p, shape))


def check_degree(degree: int, shape: SPShape, where: str = "protrain.sequence_parallel") -> None:
    """Refuse a pinned degree that breaks a constraint, naming it and the valid values."""
    broken = broken_constraints(degree, shape)
    if broken:
        raise ConfigError(f"{where} = {degree}: " + "; ".join(broken) + f". Valid values here: "
                          f"{', '.join(map(str, valid_degrees(shape)))} (or \"auto\")")
