"""Small models whose blocks return something other than the hidden state as a tensor, or keep
buffers that forward updates, for the tests that compare ProTrain with plain DeepSpeed there
(tests/test_model_outputs.py).

``OutputNet(kind)``: embeddings, blocks, a final norm and a head with the loss inside. Each block
is a residual MLP whose output is wrapped as ``kind`` says: "tensor", "dict", "model_output" (a
Hugging Face ``BaseModelOutput``), "tuple_last" (a tuple whose first element is a statistic that
needs no gradient, the hidden state second), "nested" (the hidden state inside a list inside a
dict), "box" (an object of a class of its own: no structure ProTrain can look into). With
``buffers`` the blocks and the parts around them hold BatchNorm layers (running
statistics and ``num_batches_tracked`` updated by every training forward) and a module that
counts its calls and keeps an exponential moving average in buffers of its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("dict", "model_output", "tuple_last", "nested")
VOCAB, D, SEQ = 64, 32, 8


def wrap(kind: str, h: torch.Tensor):
    if kind == "tensor":
        return h
    if kind == "dict":
        return {"hidden_states": h, "mean": h.detach().mean()}
    if kind == "model_output":
        from transformers.modeling_outputs import BaseModelOutput
        return BaseModelOutput(last_hidden_state=h)
    if kind == "tuple_last":
        return h.detach().abs().mean(-1), h
    if kind == "nested":
        return {"out": [None, (h,)], "step": 1}
    if kind == "box":
        return Box(h)
    raise ValueError(kind)


def unwrap(kind: str, out) -> torch.Tensor:
    if kind == "tensor":
        return out
    if kind == "dict":
        return out["hidden_states"]
    if kind == "model_output":
        return out.last_hidden_state
    if kind == "tuple_last":
        return out[1]
    if kind == "box":
        return out.h
    return out["out"][1][0]


class Box:
    def __init__(self, h: torch.Tensor):
        self.h = h


class Tracker(nn.Module):
    """Counts its training forwards and keeps a moving average of what it sees, in buffers."""

    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            self.ema.mul_(0.9).add_(x.detach().reshape(-1, x.size(-1)).mean(0), alpha=0.1)
        return x + self.ema


class TokenNorm(nn.Module):
    """BatchNorm over the features of every token (batch x sequence x features)."""

    def __init__(self, d: int):
        super().__init__()
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x.reshape(-1, x.size(-1))).view_as(x)


def norm(d: int, buffers: bool) -> nn.Module:
    return nn.Sequential(TokenNorm(d), Tracker(d)) if buffers else nn.LayerNorm(d)


class OutBlock(nn.Module):
    def __init__(self, kind: str, d: int, buffers: bool):
        super().__init__()
        self.kind = kind
        self.norm = norm(d, buffers)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor):
        return wrap(self.kind, x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x))))))


class OutputNet(nn.Module):
    def __init__(self, kind: str = "tensor", n_layer: int = 4, buffers: bool = False):
        super().__init__()
        self.kind = kind
        self.wte = nn.Embedding(VOCAB, D)
        self.pre = norm(D, buffers)
        self.blocks = nn.ModuleList(OutBlock(kind, D, buffers) for _ in range(n_layer))
        self.post = norm(D, buffers)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.pre(self.wte(idx))
        for block in self.blocks:
            x = unwrap(self.kind, block(x))
        logits = self.head(self.post(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def batch(i: int, micro_batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randint(0, VOCAB, (micro_batch, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]
