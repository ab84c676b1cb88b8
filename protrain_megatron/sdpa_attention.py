"""A megatron-core core-attention module on torch's scaled_dot_product_attention, with
context parallelism as Ulysses all-to-alls.

Megatron's local DotProductAttention needs CUDA and refuses context parallelism ("only
supported by TEDotProductAttention"); this module runs anywhere on Megatron's [s, b, n, h]
layout. Put it in a layer spec as
``spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention``; with
``--protrain-auto-memory`` and a context-parallel size above 1, the Megatron-LM wiring swaps
it in for the local DotProductAttention by itself (``swap_core_attention``).

Context parallelism (CP ranks, each holding 2 of the 2 CP chunks of every sequence, chunks r
and 2 CP - 1 - r: Megatron's load-balanced causal split, ``get_batch_on_this_cp_rank``): an
all-to-all turns [s / CP, heads] into [s, heads / CP] (DeepSpeed-Ulysses, Megatron's
``cp_comm_type="a2a"``), the chunks are put back in sequence order, causal attention runs on
the whole sequence for this rank's heads, and the inverse goes back. Key/value heads (GQA)
split the same way, or are replicated when there are fewer of them than CP ranks. The
all-to-all is the functional collective of protrain.sp.ulysses, which the selective block
mode keeps (a recomputed layer never re-issues it).

Causal masks only (GPT); no packed sequences.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.distributed as dist

from protrain.sp.ulysses import heads_to_seq, seq_to_heads


def zigzag_order(cp: int) -> torch.Tensor:
    """The sequence chunks (of 2 CP) in the order an all-to-all over CP ranks gathers them:
    rank r contributes chunks r and 2 CP - 1 - r."""
    return torch.tensor([c for r in range(cp) for c in (r, 2 * cp - 1 - r)])


class SDPACoreAttention(torch.nn.Module):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kw):
        super().__init__()
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale
        mask_name = getattr(attn_mask_type, "name", str(attn_mask_type))
        if mask_name != "causal":
            raise ValueError(f"SDPACoreAttention supports causal attention only (GPT), got "
                             f"attn_mask_type={mask_name}; use Transformer Engine's attention")
        self.cp_group = _cp_group(pg_collection) if getattr(config, "context_parallel_size", 1) > 1 else None
        self.cp = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        if self.cp > 1 and cp_comm_type not in (None, "a2a", "p2p", "all_gather", "a2a+p2p"):
            raise ValueError(f"cp_comm_type={cp_comm_type!r} is not a context-parallel communication type")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention: packed sequences are not supported; use Transformer "
                             "Engine's attention")
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))      # -> [b, n, s, h]
        if self.cp > 1:
            q, k, v = self._gather_sequence(q, k, v)
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0, scale=self.scale,
            enable_gqa=k.shape[1] != q.shape[1])
        if self.cp > 1:
            o = self._scatter_sequence(o)
        return o.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _gather_sequence(self, q, k, v):
        """[b, n, s / CP (2 chunks), h] on each rank -> [b, n / CP, s, h] in sequence order."""
        p = self.cp
        h, hk = q.shape[1], k.shape[1]
        if h % p or (hk % p and p % hk):
            raise ValueError(f"context parallelism {p}: attention has {h} query and {hk} key/value heads "
                             f"on this rank; CP must divide the query heads and kv_heads % CP == 0 or "
                             f"CP % kv_heads == 0")
        if hk < p:
            k, v = (t.repeat_interleave(p // hk, dim=1) for t in (k, v))
        return tuple(_to_sequence_order(seq_to_heads(t, self.cp_group, p), p) for t in (q, k, v))

    def _scatter_sequence(self, o):
        """The inverse of ``_gather_sequence`` for the attention output."""
        p = self.cp
        return heads_to_seq(_to_zigzag_order(o, p), self.cp_group, p)


@functools.lru_cache(maxsize=None)
def _chunk_index(cp: int, device: torch.device, inverse: bool) -> torch.Tensor:
    """The zig-zag chunk order (or its inverse) on ``device``, made once: built per call it
    would be a synchronous host-to-device copy from pageable memory on the compute stream,
    four times per layer per forward."""
    order = zigzag_order(cp)
    return (torch.argsort(order) if inverse else order).to(device)


def _to_sequence_order(x, cp):
    b, n, s, h = x.shape
    chunks = x.reshape(b, n, 2 * cp, s // (2 * cp), h)
    return chunks.index_select(2, _chunk_index(cp, x.device, True)).reshape(b, n, s, h)


def _to_zigzag_order(x, cp):
    b, n, s, h = x.shape
    chunks = x.reshape(b, n, 2 * cp, s // (2 * cp), h)
    return chunks.index_select(2, _chunk_index(cp, x.device, False)).reshape(b, n, s, h)


def _cp_group(pg_collection):
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None:
        from megatron.core import parallel_state
        group = parallel_state.get_context_parallel_group()
    return group


@contextmanager
def swap_core_attention(enabled: bool = True):
    """While active, attention layers built from a spec whose core attention is Megatron's
    local DotProductAttention (which refuses context parallelism) get ``SDPACoreAttention``
    instead. Used around Megatron-LM's ``get_model`` when CP > 1 and the spec is not
    Transformer Engine's; specs naming another core attention are left alone."""
    if not enabled:
        yield
        return
    from megatron.core.transformer import attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    original = attention.Attention.__init__

    @functools.wraps(original)
    def init(self, config, submodules, *args, **kwargs):
        if getattr(submodules, "core_attention", None) is DotProductAttention:
            import dataclasses
            submodules = dataclasses.replace(submodules, core_attention=SDPACoreAttention)
        original(self, config, submodules, *args, **kwargs)

    attention.Attention.__init__ = init
    try:
        yield
    finally:
        attention.Attention.__init__ = original
