"""Tiled head and loss (ALST's ``TiledFusedLogitsLoss``, arXiv 2506.13996): the LM head and the
cross-entropy over tiles of ``head_tile`` tokens, forward and backward, so that the whole
tokens x vocab logits never exist at once. At long sequences they are the largest tensors of
an iteration (Llama-3 at 64K tokens: 128256 x 65536 fp32 logits, 33.6 GB) and set the peak.

Which models: those whose loss is computed inside forward from labels by a head the runtime
recognises (``find_head``) - a Hugging Face causal LM (an ``nn.Linear`` ``lm_head`` and the
stock ``ForCausalLM`` loss) and the built-in GPT. Any other model keeps its own head, and the
planner says so (``HeadTiling.unsupported``).

How: while a training forward with labels runs under the plan (``HeadTiling.active``), the
head's ``lm_head`` returns a placeholder (``DeferredLogits``: the logits' shape, no storage)
and the model's loss function computes the loss from the head's input instead
(``TiledLinearCrossEntropy``): per tile, logits, upcast and cross-entropy summed, nothing
saved but the input; in backward each tile is recomputed and its gradients taken with the
products linear's backward takes, the weight's summed in place and handed to autograd once
(the runtime's gradient hook sees one gradient, as without tiling). The returned output's ``logits`` is ``None``; any operation on
the placeholder between the head and the loss (a model that soft-caps its logits) raises
``TiledHeadError`` naming the fix. Evaluation and generation (no autograd, or eval mode) and
forwards without labels are untouched.

Exactness: each tile runs the same operators as the untiled head; what changes is the order
of two sums - the per-token losses (tile sums, then their sum) and the weight gradient (one
product per tile, summed in the weight's dtype) - so fp32 losses agree to rounding (about 1e-7
relative), not bit for bit; in 16-bit training the weight gradient's running sum is rounded
once per tile. A plan without tiling (``head_tile`` 0) runs the model's own head.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
_MISSING = object()


class TiledHeadError(RuntimeError):
    """The model does something the tiled head cannot do for it; the message names the fix."""


FIX = "set protrain.head_tile to 0 (the model's own head), or leave it to the planner"


class TiledLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(linear(hidden, weight, bias).float(), target), computed
    ``tile`` tokens at a time; ``hidden`` [N, H], ``target`` [N]."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, tile: int, ignore_index: int):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for lo in range(0, hidden.shape[0], tile):
            logits = F.linear(hidden[lo:lo + tile], weight, bias).float()
            total += F.cross_entropy(logits, target[lo:lo + tile], ignore_index=ignore_index, reduction="sum")
            del logits
        ctx.save_for_backward(hidden, weight, bias, target)
        ctx.tile, ctx.ignore_index = tile, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, target = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # The weight's gradient is summed over the tiles in place (addmm_: no tile-sized
        # copy of it) and handed to autograd once: the runtime's hook sees one gradient.
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        for lo in range(0, hidden.shape[0], ctx.tile):
            h = hidden[lo:lo + ctx.tile]
            with torch.enable_grad():
                z = F.linear(h, weight.detach(), None if bias is None else bias.detach()).requires_grad_()
                loss = F.cross_entropy(z.float(), target[lo:lo + ctx.tile], ignore_index=ctx.ignore_index,
                                       reduction="sum")
                gz, = torch.autograd.grad(loss, z, grad_total)
            del z, loss
            # The products linear's own backward takes, per tile.
            if need_h:
                torch.mm(gz, weight, out=grad_h[lo:lo + ctx.tile])
            if need_w:
                grad_w.addmm_(gz.t(), h)
            if need_b:
                grad_b += gz.sum(0)
            del gz
        return grad_h, grad_w, grad_b, None, None, None


def tiled_causal_lm_loss(hidden: torch.Tensor, head: nn.Linear, tile: int, labels=None,
                         num_items_in_batch=None, ignore_index: int = IGNORE_INDEX,
                         shift_labels=None) -> torch.Tensor:
    """``causal_lm_loss(head(hidden), ...)``, ``tile`` tokens at a time. Under sequence
    parallelism the mean's count is the group's (protrain.sp.batch.group_count), as the
    untiled loss's is."""
    from ..sp.batch import group_count
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(hidden.device)
    h = hidden.reshape(-1, hidden.shape[-1])
    if target.shape[0] != h.shape[0]:
        raise TiledHeadError(f"the tiled head got {h.shape[0]} tokens of hidden state and "
                             f"{target.shape[0]} labels; {FIX}")
    total = TiledLinearCrossEntropy.apply(h, head.weight, head.bias, target, tile, ignore_index)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    count = group_count((target != ignore_index).sum())
    return total / count.to(total.dtype)


class DeferredLogits(torch.Tensor):
    """What ``lm_head`` returns under the tiled head: the logits' shape and dtype, no storage.
    The loss function takes it; any operation on it raises (the logits are never made)."""

    @staticmethod
    def __new__(cls, shape, dtype, device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TiledHeadError(
            f"the model applies {func} to its logits under the tiled head (protrain.head_tile), "
            f"which computes the loss from the head's input and never makes the logits - a "
            f"model that transforms them before the loss (soft-capping) or reads them in a "
            f"training forward cannot be tiled; {FIX}")

    def __repr__(self) -> str:      # noqa: D105 - the default would run an operator on it
        return f"DeferredLogits(shape={tuple(self.shape)}, dtype={self.dtype}: not materialised)"


def find_head(model: nn.Module) -> tuple[nn.Module | None, str]:
    """The module whose forward computes the head and the loss (``model`` or a module inside
    it: PEFT's wrappers), and what kind of model it is - or None and why it cannot be tiled."""
    from ..models import GPT, causal_lm_loss
    # The module that registers lm_head as its own child: a wrapper that forwards attribute
    # reads (PEFT's PeftModel) is not the one whose forward calls it.
    owners = [m for m in model.modules() if isinstance(m._modules.get("lm_head"), nn.Module)]
    if not owners:
        return None, "the model has no lm_head (only Hugging Face causal LMs and the built-in GPT are tiled)"
    owner = owners[0]
    head = owner.lm_head
    if type(head) is not nn.Linear:
        return None, (f"its lm_head is a {type(head).__name__}, not a plain torch.nn.Linear (an adapter "
                      f"or a quantised layer on the head)")
    if isinstance(owner, GPT):
        kind = "gpt"
        loss = owner.loss_function
    elif is_hf_causal_lm(owner):
        kind = "hf"
        loss = owner.loss_function
        try:
            from transformers.loss.loss_utils import ForCausalLMLoss
        except ImportError:                               # pragma: no cover - transformers < 4.46
            return None, "this transformers version has no ForCausalLMLoss"
        if loss is not ForCausalLMLoss:
            return None, (f"its loss_function is {getattr(loss, '__name__', loss)!r}, not transformers' "
                          f"ForCausalLMLoss")
        return owner, kind
    else:
        return None, f"{type(owner).__name__} is neither a Hugging Face causal LM nor the built-in GPT"
    if loss is not causal_lm_loss:
        return None, f"its loss_function is {getattr(loss, '__name__', loss)!r}, not causal_lm_loss"
    return owner, kind


def is_hf_causal_lm(module) -> bool:
    """A Hugging Face causal LM: its loss shifts ``labels`` itself (and takes shift_labels)."""
    return getattr(module, "loss_type", None) == "ForCausalLM" or (
        type(module).__name__.endswith("ForCausalLM") and hasattr(module, "loss_function"))


class HeadTiling:
    """One model's head and loss over tiles of ``tile`` tokens, in the training forwards the
    runtime wraps (``active``)."""

    def __init__(self, model: nn.Module, tile: int):
        owner, why = find_head(model)
        if owner is None:
            raise TiledHeadError(f"protrain.head_tile = {tile}: the head cannot be tiled: {why}; {FIX}")
        self.owner, self.kind, self.tile = owner, why, tile
        self.forwards = 0
        """Training forwards that computed their loss tiled (for tests and the report)."""

    @staticmethod
    def unsupported(model: nn.Module) -> str | None:
        """Why ``model``'s head cannot be tiled (None: it can)."""
        owner, why = find_head(model)
        return None if owner is not None else why

    def wants(self, args, kwargs) -> bool:
        """Whether this forward computes its loss from labels (only those are tiled: without
        labels the caller wants the logits)."""
        if self.kind == "hf":
            return kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        return (len(args) > 1 and args[1] is not None) or kwargs.get("targets") is not None

    @contextmanager
    def active(self):
        """Within: the owner's head returns ``DeferredLogits`` and its loss function computes
        the tiled loss; the owner's output has ``logits`` None."""
        owner, head, tile = self.owner, self.owner.lm_head, self.tile
        state = {"hidden": None, "placeholder": None, "used": False}

        def capture(x):
            state["hidden"] = x
            state["placeholder"] = DeferredLogits((*x.shape[:-1], head.out_features), x.dtype, x.device)
            return state["placeholder"]

        def loss_function(logits, labels=None, vocab_size=None, num_items_in_batch=None,
                          ignore_index: int = IGNORE_INDEX, shift_labels=None, **kwargs):
            if logits is not state["placeholder"] or state["hidden"] is None:
                raise TiledHeadError(f"the model's loss got logits that are not its lm_head's output "
                                     f"under the tiled head; {FIX}")
            state["used"] = True
            return tiled_causal_lm_loss(state["hidden"], head, tile, labels, num_items_in_batch,
                                        ignore_index, shift_labels)

        def strip(module, args, out):
            return _without(out, state["placeholder"])

        # HF: the loss_function property's setter keeps it in _loss_function; the GPT: a
        # plain attribute over the class's. Either way one entry of the instance's __dict__.
        name = "_loss_function" if self.kind == "hf" else "loss_function"
        before = owner.__dict__.get(name, _MISSING)
        head.forward = capture
        owner.loss_function = loss_function
        handle = owner.register_forward_hook(strip)
        try:
            yield
        finally:
            handle.remove()
            del head.forward
            if before is _MISSING:
                owner.__dict__.pop(name, None)
            else:
                owner.__dict__[name] = before
        if state["placeholder"] is not None and not state["used"]:
            raise TiledHeadError("the model called its lm_head but not its loss function under the "
                                 f"tiled head, so the logits were never made; {FIX}")
        if state["used"]:
            self.forwards += 1


def _without(out, placeholder):
    """``out`` with ``placeholder`` replaced by None (a ModelOutput, a dict, a tuple)."""
    if placeholder is None:
        return out
    if isinstance(out, dict):                  # ModelOutput included
        for k, v in list(out.items()):
            if v is placeholder:
                out[k] = None
        return out
    if isinstance(out, tuple):
        return type(out)(None if v is placeholder else v for v in out) if type(out) is tuple else out
    return None if out is placeholder else out


__all__ = ["HeadTiling", "TiledHeadError", "TiledLinearCrossEntropy", "DeferredLogits",
           "tiled_causal_lm_loss", "find_head", "is_hf_causal_lm", "IGNORE_INDEX"]
