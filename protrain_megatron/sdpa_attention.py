"""A megatron-core core-attention module on torch's scaled_dot_product_attention.

Megatron's local DotProductAttention needs CUDA; this runs anywhere (CPU tests, examples) on
Megatron's [s, b, n, h] layout: put it in a layer spec as
``spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention``. Causal
masks only (GPT); no context parallelism or packed sequences.
"""
from __future__ import annotations

import torch


class SDPACoreAttention(torch.nn.Module):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kw):
        super().__init__()
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))      # -> [b, n, s, h]
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0, scale=self.scale)
        return o.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
