"""Full weights wherever a model's weights are read through ``state_dict``.

With several data-parallel ranks an offloaded chunk's host states are sharded: between uses a
parameter of it holds no values on any rank (its ``.data`` is empty). Every way a weight file
gets written reads the weights through ``nn.Module.state_dict``: ``model.state_dict()`` and
``engine.module.state_dict()``; DeepSpeed's ``module_state_dict``, and so
``engine.save_16bit_model``; accelerate's ``get_state_dict``, which below ZeRO stage 3 takes
the unwrapped model's state_dict on every rank, and so the Hugging Face Trainer's
``save_model``; ``save_pretrained`` without a state_dict. So the state_dict of any module
whose subtree holds sharded parameters gathers their values (an all-gather per chunk, what
ZeRO-3 does under ``stage3_gather_16bit_weights_on_model_save``, done by default): every
caller gets full tensors, on the host, in the training dtype, never an empty one.

A gather is a collective: every rank must call state_dict, as with ZeRO-3. The Trainer and
accelerate do (the Trainer gathers on every rank, then writes on the main process only, with
the gathered dict); ``save_pretrained`` or ``state_dict`` called on the main process only, as
some scripts do, does not. Such a call must neither hang nor write empty tensors: before the
collective the ranks meet (``DataParallel.rendezvous``), and a call the other ranks never
make fails with their ranks and the way out (``fix``). Nothing about the ranks is assumed
from the call itself: they are asked.

While a state_dict lives it holds the whole model in the training dtype on every rank that
called it (as FSDP's full state dict does by default).

``state_dict(keep_vars=True)`` asks for the Parameter objects themselves (load and tie
helpers, not savers): nothing is gathered. Inside ``local()`` nothing is either (one rank
reading buffers and frozen parameters alone).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from .chunks import Chunk, ChunkManager


class FullStateDict:
    """State-dict hooks on every module of ``model``: the outermost call (the module
    state_dict was called on) syncs the host updates; the first post-hook that meets a
    sharded parameter gathers every sharded chunk of that module's subtree, once per call."""

    def __init__(self, model: nn.Module, chunks: ChunkManager, *, timeout_s: float | None = None,
                 fix: str = ""):
        self.chunks = chunks
        self.timeout_s = timeout_s
        """Seconds a rank waits for the others before the gather (None: the process group's
        timeout)."""
        self.fix = fix
        """The way out, for the error of a state_dict some ranks never call."""
        self._local = 0
        self._call: _Call | None = None
        sharded = {s.param for c in chunks.streamed() for s in c.slots} if chunks.dp.world > 1 else set()
        self._handles = []
        for module in model.modules():
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if p in sharded]
            self._handles.append(module.register_state_dict_pre_hook(self._enter))
            self._handles.append(module.register_state_dict_post_hook(
                lambda mod, sd, prefix, meta, own=own: self._leave(mod, sd, prefix, own)))
        self._sharded = sharded

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextmanager
    def local(self) -> Iterator[None]:
        """State dicts in this context gather nothing (sharded parameters stay empty): for
        reading buffers and frozen parameters on one rank alone."""
        self._local += 1
        try:
            yield
        finally:
            self._local -= 1

    # ---- hooks ---------------------------------------------------------------------------
    def _enter(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        call = self._call
        if call is not None and id(module) in call.inside and len(prefix) > len(call.prefix) \
                and prefix.startswith(call.prefix):
            return                           # a submodule of the call in progress
        # The outermost call (a call interrupted by an error left nothing that matters: this
        # one starts afresh, so no earlier gather is ever reused).
        self.chunks.host_sync()              # offloaded values may still be being updated
        sharded = sorted({self.chunks.slot_of[p][0].index for p in module.parameters()
                          if p in self._sharded})
        self._call = _Call(module, prefix, {id(m) for m in module.modules()},
                           gather=bool(sharded) and not keep_vars and not self._local,
                           chunks=[self.chunks.chunks[i] for i in sharded])

    def _leave(self, module: nn.Module, sd: dict, prefix: str, own) -> None:
        call = self._call
        if call is None:
            return
        if own and call.gather:
            if call.full is None:
                try:
                    call.full = self.chunks.gathered(
                        call.chunks, what=f"state_dict() of {type(call.root).__name__}",
                        timeout_s=self.timeout_s, fix=self.fix)
                except BaseException:
                    self._call = None
                    raise
            for name, p in own:
                if prefix + name in sd:
                    sd[prefix + name] = call.full[p]
        if module is call.root and prefix == call.prefix:
            self._call = None                # the gathered values live on in ``sd`` only


class _Call:
    """One outermost state_dict call in progress."""

    def __init__(self, root: nn.Module, prefix: str, inside: set[int], *, gather: bool,
                 chunks: list[Chunk]):
        self.root = root
        self.prefix = prefix
        self.inside = inside
        """ids of the root's modules (its submodules' calls are part of this one)."""
        self.gather = gather
        self.chunks = chunks
        """The sharded chunks of the root's subtree, in index order (the same on every rank)."""
        self.full: dict[nn.Parameter, torch.Tensor] | None = None
