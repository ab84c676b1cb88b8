"""A small GPT (GPT-2 architecture) for the README's main job, the tests and the benchmarks.

Self-contained so that everything runs without downloads. Its layout follows Hugging Face's
GPT-2 (``transformer.wte``, ``transformer.h`` as the block list, tied ``lm_head``) so the
block finder sees the same structure it sees in real models.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    vocab_size: int = 512
    block_size: int = 128
    """Longest sequence (size of the learned position table)."""
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    """Share the token embedding with the output head, as GPT-2 does."""


PRESETS = {
    "gpt-tiny": GPTConfig(),
    "gpt-small": GPTConfig(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, block_size=1024),
    "gpt-1b": GPTConfig(n_layer=24, n_embd=2048, n_head=16, vocab_size=50257, block_size=1024),
}


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.n_head, h // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, s, h)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = SelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


IGNORE_INDEX = -100


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor | None = None, vocab_size: int | None = None,
                   num_items_in_batch=None, ignore_index: int = IGNORE_INDEX,
                   shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` (transformers.loss.loss_utils), the GPT's loss:
    logits upcast to fp32, ``labels`` shifted left by one (or ``shift_labels`` as given),
    cross-entropy averaged over the targets that are not ``ignore_index`` - summed and divided
    by ``num_items_in_batch`` where given."""
    logits = logits.float()
    vocab_size = vocab_size or logits.size(-1)
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits.view(-1, vocab_size), shift_labels.reshape(-1).to(logits.device),
                           ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None):
        """Logits, or the mean cross-entropy loss when ``targets`` is given. ``position_ids``
        (default 0..s-1) place a slice of a longer sequence (sequence parallelism)."""
        _, s = idx.shape
        pos = torch.arange(s, device=idx.device) if position_ids is None else position_ids
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        return self.loss_function(logits=logits, vocab_size=self.config.vocab_size, shift_labels=targets)

    # Hugging Face's name and signature: the tiled head (protrain.runtime.tiled_head) replaces
    # it, with the head's forward, while a training forward runs under a plan that tiles.
    loss_function = staticmethod(causal_lm_loss)


def synthetic_batch(cfg: GPTConfig, micro_batch: int, seq_len: int | None = None, *,
                    device="cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets from a fixed random stream (no data download). The
    stream repeats a short pattern so a model can actually learn it: loss goes down."""
    seq_len = seq_len or cfg.block_size
    g = torch.Generator().manual_seed(seed)
    period = 17
    pattern = torch.randint(0, cfg.vocab_size, (micro_batch, period), generator=g)
    reps = (seq_len + 1 + period - 1) // period + 1
    stream = pattern.repeat(1, reps)
    offset = torch.randint(0, period, (1,), generator=g).item()
    seq = stream[:, offset:offset + seq_len + 1]
    return seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)
