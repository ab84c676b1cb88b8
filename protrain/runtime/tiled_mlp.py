"""Tiled MLP (issue 36 item 2; ALST's ``TiledMLP``): a block's MLP over tiles of the sequence,
recomputed tile by tile in backward, so only one tile's intermediates exist at a time (Llama-3's
MLP makes s x 14336 several times over: at long sequences the largest tensors of a block).

The MLP is applied token by token, so a tile's output is the MLP of the tile's tokens: the
forward runs each tile without autograd and keeps only the MLP's input; the backward runs each
tile again with autograd and takes its gradients. Unlike DeepSpeed's ``TiledMLP`` (autograd run
per shard into ``param.grad``, ZeRO's reduction held back with ``ds_grad_is_ready``), the MLP's
parameters are inputs of the autograd function here: their gradients, summed over the tiles in
the parameters' dtype, reach autograd once - the chunk runtime's gradient hook
(``register_post_accumulate_grad_hook``) sees one gradient per backward, as without tiling.

Exactness: each tile runs the MLP's own operators on its rows; the weight gradients are summed
over the tiles (another order than one matrix product over all tokens): fp32 results agree to
rounding, not bit for bit. An MLP with active dropout is refused (its recompute would draw other
masks). The planner chooses the tile (``Knobs.mlp_tile``, protrain.search.mlp); the runtime
installs ``MLPTiling`` for its life.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Sequence

import torch
from torch import nn

from .forward_patches import ForwardPatches

TILE_DIM = 0
"""Tiles are rows of the MLP's input flattened to [tokens, hidden] (batch and sequence
together): a tile of ``tile`` tokens whatever the batch's shape, as the planner prices it
(``ModelProfile.tokens``: tokens per micro-batch and rank)."""


class TiledMLPError(RuntimeError):
    """An MLP that cannot be tiled (the message names the module and the fix)."""


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter's gradient is summed over the tiles in: fp32 for 16-bit parameters
    (a 16-bit running sum would round once per tile), else its own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _TiledMLP(torch.autograd.Function):
    """``forward(x)`` over tiles of ``tile`` tokens; the parameters are inputs so that their
    gradients leave in one piece. The recompute in backward runs under the autocast state the
    forward ran under (as torch's checkpoint does)."""

    @staticmethod
    def forward(ctx, forward, tile: int, x: torch.Tensor, *params: nn.Parameter) -> torch.Tensor:
        ctx.forward, ctx.tile, ctx.params = forward, tile, params
        kind = x.device.type
        ctx.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        ctx.save_for_backward(x)
        with torch.no_grad():
            outs = [forward(t) for t in x.split(tile, dim=TILE_DIM)]
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise TiledMLPError(f"protrain: the MLP returned {type(outs[0]).__name__}, not one tensor, "
                                f"which tiles cannot join; set protrain.mlp_tile to 0")
        return torch.cat(outs, dim=TILE_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        want = [i for i, need in enumerate(ctx.needs_input_grad[3:]) if need]
        params = [ctx.params[i] for i in want]
        dx = torch.empty_like(x) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        start = 0
        kind, enabled, dtype = ctx.autocast
        for xt, gt in zip(x.split(ctx.tile, dim=TILE_DIM), grad.split(ctx.tile, dim=TILE_DIM)):
            xt = xt.detach().requires_grad_(want_x)
            with torch.enable_grad(), torch.autocast(kind, dtype=dtype, enabled=enabled):
                yt = ctx.forward(xt)
            got = torch.autograd.grad(yt, ([xt] if want_x else []) + params, gt, allow_unused=True)
            del yt                          # the tile's graph goes before the next tile's
            if want_x:
                dx.narrow(TILE_DIM, start, xt.shape[TILE_DIM]).copy_(got[0])
                got = got[1:]
            for k, g in enumerate(got):
                if g is not None:
                    if sums[k] is None:
                        sums[k] = g.to(sum_dtype(g.dtype), copy=g.dtype != sum_dtype(g.dtype))
                    else:
                        sums[k].add_(g)
            start += xt.shape[TILE_DIM]
            got = g = None                  # this tile's gradients go before the next tile's
        out: list[torch.Tensor | None] = [None] * len(ctx.params)
        for i, s in zip(want, sums):
            out[i] = s if s is None else s.to(params[want.index(i)].dtype)
        return (None, None, dx, *out)


def unsupported(mlp: nn.Module, dropout: bool = True) -> str | None:
    """Why ``mlp`` cannot be tiled (None: it can): a mixture of experts (its router's outputs,
    which the load-balancing loss reads, would be taken tile by tile), forward hooks on it or
    inside it (they would see each tile, not the MLP's call), with ``dropout`` a dropout module
    that is active in training (its recompute would draw other masks; functional dropout and
    other randomness the profiler catches: ``measure.profiler``'s tiling check)."""
    for name, m in mlp.named_modules():
        where = f"{type(mlp).__name__}{'.' + name if name else ''}"
        kind = type(m).__name__.lower()
        if "expert" in kind or "router" in kind or "moe" in kind or name.split(".")[-1] in ("experts", "router"):
            return (f"{where} ({type(m).__name__}) is part of a mixture of experts, whose routing "
                    f"statistics a tiled MLP would take tile by tile")
        if m._forward_hooks or m._forward_pre_hooks:
            return f"{where} has forward hooks, which would see each tile rather than the MLP's call"
        if not dropout:
            continue
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return (f"{type(mlp).__name__}{'.' + name if name else ''} has dropout p={m.p}, which a "
                    f"recompute per tile would draw again differently")
    return None


def tiled_mlp(mlp: nn.Module, x: torch.Tensor, tile: int, forward=None, norm: nn.Module | None = None) -> torch.Tensor:
    """``mlp(x)`` over tiles of ``tile`` tokens along the sequence (``forward``: the MLP's own
    forward, default ``mlp.forward``); as ``mlp(x)`` where there is one tile or no autograd.
    ``norm``: a module whose parameters ``forward`` uses too (the MLP's pre-norm, fused)."""
    forward = forward or mlp.forward
    if tile <= 0:
        raise ValueError(f"tile={tile}: a number of tokens, at least 1")
    if not torch.is_grad_enabled() or x.numel() <= tile * x.shape[-1]:
        return forward(x)
    if mlp.training:
        why = unsupported(mlp)
        if why:
            raise TiledMLPError(f"protrain: the MLP cannot be tiled: {why}; set the dropout to 0 or plan "
                                f"without the tiled MLP")
    params = [p for m in (mlp, norm) if m is not None for p in m.parameters() if p.requires_grad]
    # A view where the input is contiguous (the saved tensor is then the input's own storage).
    rows = x.reshape(-1, x.shape[-1])
    y = _TiledMLP.apply(forward, tile, rows, *params)
    return y.view(*x.shape[:-1], y.shape[-1])


def find_mlps(blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """Each block's MLP: its ``mlp`` submodule (Hugging Face decoder layers, the built-in GPT).
    A block without one is refused by name."""
    out = []
    for i, b in enumerate(blocks):
        mlp = getattr(b, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise TiledMLPError(f"block {i} ({type(b).__name__}) has no `mlp` submodule to tile")
        out.append(mlp)
    return out


PRE_NORMS = ("pre_feedforward_layernorm", "post_attention_layernorm", "ln_2")
"""The norm whose output is a block's MLP's input, by the name the families give it, first found
first (Gemma 2 and 3: ``pre_feedforward_layernorm``, their ``post_attention_layernorm`` norms the
attention's output; Hugging Face Llama, Mistral, Qwen2, Phi-3: ``post_attention_layernorm``;
GPT-2 and the built-in GPT: ``ln_2``). A guess by name, checked on the model before use
(``MLPTiling``)."""


def find_pre_norms(blocks: Sequence[nn.Module]) -> list[nn.Module] | None:
    """Each block's MLP's pre-norm (``PRE_NORMS``), or None where a block has none."""
    out = []
    for b in blocks:
        norm = next((getattr(b, n) for n in PRE_NORMS if isinstance(getattr(b, n, None), nn.Module)), None)
        if norm is None:
            return None
        out.append(norm)
    return out


class MLPTiling:
    """The MLPs of ``blocks`` over tiles of ``tile`` tokens while ``active``. ``with_norm``:
    each MLP's pre-norm (``find_pre_norms``) runs inside the tiles too - the norm returns its
    input, which the MLP's tiles normalise - so neither the norm's saved tensors (an RMSNorm's
    fp32 copy and its normalised input) nor its output are kept for the whole sequence, only the
    input. Only where the norm's output goes to the MLP and nowhere else: the profiler checks it
    on the model (``norm_fusable``), and the MLP refuses an input that is not the norm's."""

    def __init__(self, blocks: Sequence[nn.Module], tile: int, with_norm: bool = False):
        self.mlps = find_mlps(blocks)
        self.norms = find_pre_norms(blocks) if with_norm else None
        if with_norm and self.norms is None:
            raise TiledMLPError(f"the blocks have no pre-norm ({' or '.join(PRE_NORMS)}) to tile with their MLPs")
        self.tile = tile
        self._patches: ForwardPatches | None = None

    def install(self) -> "MLPTiling":
        """Tile from now until ``remove``: the runtime's way, for its whole life - a checkpointed
        block's recompute (in backward, outside any forward) must tile as its forward did, or
        it would save other tensors than the forward did."""
        why = next((w for w in (unsupported(m, dropout=False) for m in self.mlps) if w), None)
        if why:
            raise TiledMLPError(f"protrain: the MLPs cannot be tiled: {why}; set protrain.mlp_tile to 0")
        if self._patches is None:
            self._patches = ForwardPatches()
            for i, mlp in enumerate(self.mlps):
                if self.norms is None:
                    self._patches.replace(mlp, self._tiles(i, mlp, mlp.forward))
                else:
                    self._fuse(i, mlp, self.norms[i])
        return self

    def _tiles(self, i: int, mlp: nn.Module, forward, norm: nn.Module | None = None, before=None):
        """The tiled forward of block ``i``'s MLP: one tensor in (else refused by name: the
        tiles are rows of one input), ``before(x)`` checked first."""
        def tiles(*args, **kwargs):
            if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
                raise TiledMLPError(
                    f"protrain: block {i}'s MLP ({type(mlp).__name__}) was called with "
                    f"{len(args)} positional and {len(kwargs)} keyword arguments; a tiled MLP takes "
                    f"one tensor; set protrain.mlp_tile to 0")
            if before is not None:
                before(args[0])
            return tiled_mlp(mlp, args[0], self.tile, forward, norm=norm)
        return tiles

    def _fuse(self, i: int, mlp: nn.Module, norm: nn.Module) -> None:
        norm_forward, mlp_forward = norm.forward, mlp.forward
        handed: list = [None]           # a weak reference to the norm's last input

        def norm_pass(x):
            handed[0] = weakref.ref(x)
            return x

        def check(x):
            given = handed[0]() if handed[0] is not None else None
            handed[0] = None
            if given is not x:
                raise TiledMLPError(
                    f"protrain: block {i}'s MLP was given something other than its norm's output, which "
                    f"the tiled MLP normalises itself (mlp_tile with the norm fused); set protrain.mlp_tile "
                    f"to 0")
        self._patches.replace(norm, norm_pass)
        self._patches.replace(mlp, self._tiles(i, mlp, lambda t: mlp_forward(norm_forward(t)), norm, check))

    def remove(self) -> None:
        """The MLPs' own forwards back."""
        if self._patches is not None:
            self._patches.restore()
            self._patches = None

    @contextmanager
    def active(self):
        self.install()
        try:
            yield self
        finally:
            self.remove()


__all__ = ["MLPTiling", "TiledMLPError", "find_mlps", "find_pre_norms", "tiled_mlp", "unsupported", "PRE_NORMS"]
