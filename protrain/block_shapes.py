"""Small models whose blocks have the shapes the built-in GPT's do not, for the memory and
runtime models' tests and benchmarks.

The GPT's blocks all look alike to the memory model: each saves its input (its first op is a
LayerNorm), its output is saved by the next block only, and its forward peak is its saved
tensors plus the MLP's widest intermediate. Real models differ, and each difference moves a
term of the model:

- ``relu_tail``: the block ends in an op that saves its own output (ReLU saves its result).
  That output is also the next block's input, so the block's mode cannot free it: CKPT and
  SWAP free less than ``saved - in``, and the next block does not own its input.
- ``wide_temp``: a large forward-only temporary (a no-grad statistic over a wide expansion,
  as position encodings or routing scores are computed). Recomputing the block makes it again
  in backward, so the recompute bump - not a plain backward - is the peak of a CKPT block.
- ``gated_residual``: a highway residual, ``g * x + (1 - g) * f(x)`` with a learned gate: the
  residual path itself saves tensors (the gate and the input for the product).
- ``moe``: top-1 routing over experts: data-dependent gathers (``index_select``) and scatters
  (``index_add``), saved index tensors, and experts that see only part of the tokens.

Every kind is a ``ShapeNet``: token embedding, ``blocks`` (a ModuleList of one block class),
a final norm and an untied head with a cross-entropy loss, so the block finder, the profiler
and the runtime treat it as they treat any transformer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("relu_tail", "wide_temp", "gated_residual", "moe")


@dataclass(frozen=True)
class ShapeConfig:
    kind: str = "relu_tail"
    """Block shape, one of ``KINDS``."""
    n_layer: int = 4
    """Number of blocks."""
    n_embd: int = 64
    """Width of the residual stream."""
    vocab_size: int = 128
    """Tokens of the embedding and the head."""
    wide: int = 16
    """``wide_temp``: the temporary is ``wide`` times the block input."""
    n_expert: int = 4
    """``moe``: number of experts (top-1 routing)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ShapeConfig.kind={self.kind!r} is not one of {KINDS}")


class _MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ReluTailBlock(nn.Module):
    def __init__(self, cfg: ShapeConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.mlp = _MLP(cfg.n_embd, 4 * cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.mlp(self.ln(x)))


class WideTempBlock(nn.Module):
    def __init__(self, cfg: ShapeConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.mlp = _MLP(cfg.n_embd, 2 * cfg.n_embd)
        self.register_buffer("freqs", torch.linspace(0.1, 3.0, cfg.wide), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        with torch.no_grad():
            # [.., n_embd, wide] made and dropped inside forward: never saved for backward.
            scale = torch.cos(h.unsqueeze(-1) * self.freqs).mean(-1)
        return x + self.mlp(h * scale)


class GatedResidualBlock(nn.Module):
    def __init__(self, cfg: ShapeConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.mlp = _MLP(cfg.n_embd, 4 * cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(self.gate(x))
        return g * x + (1 - g) * self.mlp(self.ln(x))


class MoEBlock(nn.Module):
    def __init__(self, cfg: ShapeConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.router = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        self.experts = nn.ModuleList(_MLP(cfg.n_embd, 2 * cfg.n_embd) for _ in range(cfg.n_expert))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x).reshape(-1, x.shape[-1])
        prob = self.router(h).softmax(-1)
        gate, choice = prob.max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            sel = (choice == e).nonzero().squeeze(1)
            y = expert(h.index_select(0, sel)) * gate.index_select(0, sel).unsqueeze(1)
            out = out.index_add(0, sel, y)
        return x + out.view_as(x)


BLOCKS = {"relu_tail": ReluTailBlock, "wide_temp": WideTempBlock,
          "gated_residual": GatedResidualBlock, "moe": MoEBlock}


class ShapeNet(nn.Module):
    def __init__(self, cfg: ShapeConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(BLOCKS[cfg.kind](cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def shape_batch(cfg: ShapeConfig, micro_batch: int, seq_len: int, *, seed: int = 0):
    """Token ids and shifted targets from a fixed random stream."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
