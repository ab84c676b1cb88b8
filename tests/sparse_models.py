"""Models whose parameters do not all get a gradient in every step, for the tests that
compare ProTrain with plain DeepSpeed there: a GPT with a branch taken every other step, and
a GPT whose MLPs are top-1 mixtures of experts (experts that get no token get no gradient)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from protrain.models import GPT, Block, GPTConfig


class BranchBlock(Block):
    """A GPT block whose MLP can be left out (``mlp_on``)."""

    mlp_on = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x)) if self.mlp_on else x


class BranchGPT(GPT):
    """The built-in GPT (same weights) with a branch: while ``branch`` is False, the embeddings
    and block 0 run without gradients (a part of the model frozen in that step: backward never
    reaches its chunks, which may sit in a buffer, cached or prefetched, through the step) and
    block 1 runs without its MLP (parameters without a gradient in chunks that get some)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg)
        for block in self.transformer.h:      # blocks stay one type (the block finder's rule)
            block.__class__ = BranchBlock
        self.branch = True

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        _, s = idx.shape
        self.transformer.h[1].mlp_on = self.branch
        with torch.set_grad_enabled(self.branch and torch.is_grad_enabled()):
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(torch.arange(s)))
            x = self.transformer.h[0](x)
        for block in self.transformer.h[1:]:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


class Expert(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.w_in = nn.Linear(n_embd, n_embd, bias=False)
        self.w_out = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.silu(self.w_in(x)))


class TopOneExperts(nn.Module):
    """Mixtral-like routing, top-1: a router with a bias picks one expert per token; an expert
    that gets no token is not called, so its parameters get no gradient in that step (the
    router's bias starts spread out so that some experts get none)."""

    def __init__(self, n_embd: int, n_experts: int):
        super().__init__()
        self.router = nn.Linear(n_embd, n_experts, bias=True)
        self.experts = nn.ModuleList(Expert(n_embd) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))
        weight, choice = F.softmax(self.router(flat), dim=-1).max(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(-1)
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * weight[rows, None])
        return out.view_as(x)


class MoEGPT(GPT):
    """The built-in GPT with every block's MLP replaced by ``n_experts`` top-1 experts."""

    def __init__(self, cfg: GPTConfig, n_experts: int = 8):
        super().__init__(cfg)
        torch.manual_seed(1)
        for block in self.transformer.h:
            block.mlp = TopOneExperts(cfg.n_embd, n_experts)
            block.mlp.apply(self._init)
            nn.init.normal_(block.mlp.router.bias, std=1.0)
