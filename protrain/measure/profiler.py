"""profile_model: one traced training iteration of the user's real model -> ModelProfile.

Passes (forward + backward each, no optimizer step; weights are never changed):
1. warm-up: lazy initialisation, kernel autotuning, allocator warm-up;
2. plain: two un-hooked iterations, the faster timed, to rescale the hooked timings (when the
   parameters are streamed the model cannot run without hooks: one iteration with the
   streaming hooks alone, its uploads timed and subtracted);
3. timing: block boundaries marked (CUDA events on GPU, perf_counter on CPU) to get per-part
   forward and backward times (uploads of streamed weights between marks of their own, so
   they count for no part);
4. memory: every aten op goes through a dispatch mode (``runtime.meter.OpRecorder``) that reports
   the live bytes around it; saved-tensor hooks count what autograd keeps per part.

Parts are cut at the block boundaries: forward pre/post hooks on each block, and gradient
hooks on each block's input and output tensors for backward. RNG state and the model's buffers
(BatchNorm's running statistics, counters) are restored before every pass and at the end, so
profiling changes neither the weights, nor the buffers, nor the random stream the training run
sees. The passes are training iterations whatever the caller's mode: under autograd (a first
forward under ``torch.no_grad()``, an evaluation before training, is profiled all the same) and,
for a model in eval mode, in train mode; each module's mode is put back afterwards.

A model whose parameters do not fit on the device is profiled by *streaming*: each block's
parameters are copied in just before the block runs (forward and backward) and dropped
right after; saved references to parameters are replaced by placeholders so the copies are
really freed.
"""
from __future__ import annotations

import time
import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from ..profile.blocks import find_blocks
from ..profile.model_profile import HeadProfile, MLPProfile, ModelProfile, OpRecord, ParamRecord, PartProfile
from ..runtime.boundaries import BlockOrderError, part_boundaries, position_names, tensors_in, version
from ..runtime.buffers import ModuleState
from ..runtime.meter import AllocatorMeter, OpRecorder, StorageMeter, StorageRegistry, storage_ptr
from ..runtime.streams import Streams
from .attention import AttentionTimer, KeptBytes

StepFn = Callable[[nn.Module], torch.Tensor]


@dataclass
class _PartStats:
    fwd_time: float = 0.0
    bwd_time: float = 0.0
    in_bytes: int = 0
    saved_bytes: int = 0
    fwd_start: int = 0
    fwd_peak: int = 0
    bwd_start: int = 0
    bwd_peak: int = 0
    kept_bytes: int = 0
    resaved_bytes: int = 0
    in_shared_bytes: int = 0


class _SaveLedger:
    """Who saved what in the memory pass: each saved storage's owner (whose ``saved_bytes``
    count it: its first saver, or the earlier part that allocated it) and every later part that saved it too, and each part's input.
    From these, per part: ``kept_bytes`` (owned storages a later part also saves),
    ``resaved_bytes`` (storages it saves that an earlier part owns) and ``in_shared_bytes`` (an
    input an earlier part owns). Saved storages live until backward,
    so during forward an address names one storage; inputs are checked by identity, as an
    input nobody saved may die and its address be reused."""

    def __init__(self):
        self.owner: dict[int, tuple[int, int]] = {}      # ptr -> (first saving part, bytes)
        self.savers: dict[int, set[int]] = {}            # ptr -> every part that saved it
        self.inputs: dict[int, tuple[int, weakref.ref]] = {}   # part -> (ptr, its storage)

    def saved(self, part: int, ptr: int, nbytes: int, owner: int | None = None) -> bool:
        """Note that ``part`` saves a storage; True the first time it is saved: its owner is
        then ``owner`` (default ``part``; an earlier part when that one allocated it)."""
        self.savers.setdefault(ptr, set()).add(part)
        if ptr in self.owner:
            return False
        self.owner[ptr] = (part if owner is None else owner, nbytes)
        return True

    def entered(self, part: int, x: torch.Tensor) -> None:
        ptr = storage_ptr(x)
        if ptr:
            self.inputs[part] = (ptr, weakref.ref(x.untyped_storage()))

    def finish(self, stats) -> None:
        """At the end of forward (every saved storage still alive)."""
        for ptr, (part, nbytes) in self.owner.items():
            later = [q for q in self.savers[ptr] if q > part]
            if later:
                stats[part].kept_bytes += nbytes
            for q in later:
                stats[q].resaved_bytes += nbytes
        for part, (ptr, ref) in self.inputs.items():
            owner = self.owner.get(ptr)
            if ref() is not None and owner is not None and owner[0] < part:
                stats[part].in_shared_bytes = stats[part].in_bytes


class _ParamStreamer:
    """Keeps block parameters in host memory and brings one block's parameters to the device
    at a time. On CPU (tests) the "device copy" is a fresh clone, so the same paths run.

    The host copies live in one pinned region per block (and dtype), exactly sized and
    registered through ``Streams.pinned`` (torch's pinned caching allocator would round every
    parameter up to a power of two and keep the memory after it is freed). They replace the
    parameters' tensors block by block, and ``restore`` gives every parameter a tensor of its
    own back and each region back to the system, block by block: at most one block's weights
    exist twice at any time."""

    def __init__(self, blocks: Sequence[nn.Module], device: torch.device, meter_exclude):
        self.device = device
        self.streams = Streams(device)
        self.block_params = [[p for p in b.parameters()] for b in blocks]
        self.home: dict[nn.Parameter, torch.Tensor] = {}
        self.regions: list[tuple[list[nn.Parameter], torch.Tensor]] = []
        for params in self.block_params:
            mine = list(dict.fromkeys(p for p in params if p not in self.home))
            for dtype in dict.fromkeys(p.dtype for p in mine):
                group = [p for p in mine if p.dtype == dtype]
                region = self.streams.pinned(sum(p.numel() for p in group), dtype)
                off = 0
                for p in group:
                    home = region[off:off + p.numel()].view(p.shape)
                    home.copy_(p.data)
                    self.home[p] = home
                    p.data = home           # the parameter's own tensor can go now
                    off += p.numel()
                self.regions.append((group, region))
        self.loaded: set[int] = set()
        self.max_loaded = 0
        self.meter_exclude = meter_exclude

    def _bytes(self, i: int) -> int:
        return sum(p.numel() * p.element_size() for p in self.block_params[i])

    def load(self, i: int) -> None:
        if i in self.loaded:
            return
        for p in self.block_params[i]:
            # From pinned memory without blocking the host: a blocking copy would drain the
            # compute stream at every boundary and leave the device idle while the next
            # kernels are launched, time the profile would charge to the blocks.
            p.data = self.home[p].to(self.device, copy=True, non_blocking=True)
        self.loaded.add(i)
        self.max_loaded = max(self.max_loaded, len(self.loaded))
        self.meter_exclude(self._bytes(i))

    def unload(self, i: int) -> None:
        if i not in self.loaded:
            return
        for p in self.block_params[i]:
            p.data = self.home[p]
        self.loaded.discard(i)
        self.meter_exclude(-self._bytes(i))

    def restore(self, original: dict[nn.Parameter, torch.device]) -> None:
        for i in list(self.loaded):
            self.unload(i)
        self.streams.synchronize()          # no upload still reads a region
        for group, region in self.regions:
            for p in group:
                p.data = self.home.pop(p).to(original.get(p, self.device), copy=True)
            self.streams.unpin(region)
        self.regions = []


class _Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed(self, a, b) -> float:
        if self.cuda:
            return a.elapsed_time(b) / 1e3
        return b - a

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def profile_model(model: nn.Module, step: StepFn, *, blocks: Sequence[nn.Module] | None = None,
                  device: torch.device | str | None = None, stream_params: bool | None = None,
                  name: str | None = None, micro_batch: int | None = None,
                  seq_len: int | None = None, progress: bool = True,
                  head_tiling: bool = False, mlp_tiling: bool = False) -> ModelProfile:
    """Profile one training iteration of ``model``.

    ``head_tiling``: also measure the post part with the head and loss over tiles
    (``ModelProfile.head``; two more memory passes), where the model's head can be tiled.
    ``mlp_tiling``: also measure the blocks with their MLPs over tiles (``ModelProfile.mlp``;
    two more memory passes), where the blocks' MLPs can be tiled.

    ``step(model)`` must run the forward pass on a fixed batch and return the scalar loss; the
    profiler calls ``backward`` itself. ``blocks`` defaults to the repeated children of the
    model's layer list. ``device`` defaults to the device of the model's parameters; if the
    parameters are elsewhere (a model too big for the device, kept on the host), or
    ``stream_params`` is set, block parameters are streamed through the device one block at
    a time.

    The profile is of the eager model: functions and modules compiled with torch.compile
    inside it run eager here (the hooks and dispatch modes that measure it see eager
    operators only); a torch.compile'd model itself is refused.
    """
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError(
            "ProTrain profiles the eager model, and got a torch.compile'd one (OptimizedModule): "
            "pass its eager module (model._orig_mod) to profile_model; ProTrain compiles the "
            "blocks itself once the plan is made (protrain.runtime.compile)")
    if blocks is None:
        _, blocks = find_blocks(model)
    blocks = list(blocks)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(model).__name__} has no trainable parameters to profile")
    device = torch.device(device) if device is not None else params[0].device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if stream_params is None:
        stream_params = any(p.device != device for p in params)
    tracer = _Tracer(model, step, blocks, params, device, stream_params, progress)
    try:
        with _eager(), torch.inference_mode(False), torch.enable_grad():
            return tracer.run(name=name or type(model).__name__, micro_batch=micro_batch, seq_len=seq_len,
                              head_tiling=head_tiling, mlp_tiling=mlp_tiling)
    finally:
        tracer.restore()


def _eager():
    """Everything torch.compile'd runs eager (torch >= 2.6; older ones have no stance)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else nullcontext()


class _Tracer:
    def __init__(self, model, step, blocks, params, device, stream, progress):
        self.model, self.step, self.blocks, self.params = model, step, blocks, params
        self.device, self.stream, self.progress = device, stream, progress
        self.n_parts = len(blocks) + 2
        self.param_index = {p: i for i, p in enumerate(params)}
        self.original_devices = {p: p.device for p in params}
        self.clock = _Clock(device)
        self.rng = _RngState(device)
        self.module_state = ModuleState(model)
        if not model.training:
            # The profile is of a training iteration (dropout on, BatchNorm on the batch's
            # statistics); ``restore`` puts every module's own mode back.
            model.train()
        self.streamer: _ParamStreamer | None = None
        self.inplace_blocks: tuple[str, ...] = ()     # blocks changing an input in place
        self.registry: StorageRegistry | None = None
        self.meter = None
        self.bar = None
        self.state = ("fwd", 0)          # (phase, part) the iteration is in
        self.param_of_ptr: dict[int, int] = {}
        self.created: dict[int, int] = {}     # storage -> part that allocated it (memory pass)
        self.part_input: dict[int, int] = {}  # part -> storage of its input activation
        self.block_of_param: dict[nn.Parameter, int] = {}
        for i, b in enumerate(blocks):
            for p in b.parameters():
                self.block_of_param.setdefault(p, i)
        if stream:
            # Non-block parameters (embeddings, head) stay on the device while profiling.
            for p in params:
                if p not in self.block_of_param and p.device != device:
                    p.data = p.data.to(device)
            self.streamer = _ParamStreamer(blocks, device, self._exclude)

    # ---- lifecycle ---------------------------------------------------------------------
    def restore(self) -> None:
        if self.streamer is not None:
            self.streamer.restore(self.original_devices)
        for p, dev in self.original_devices.items():
            if p.device != dev:
                p.data = p.data.to(dev)
            p.grad = None
        self.rng.restore()
        self.module_state.restore()

    def _exclude(self, nbytes: int) -> None:
        if self.meter is not None:
            self.meter.exclude(nbytes)

    def run(self, *, name, micro_batch, seq_len, head_tiling: bool = False,
            mlp_tiling: bool = False) -> ModelProfile:
        from tqdm.auto import tqdm
        from ..runtime.tiled_head import HeadTiling
        tokens = (micro_batch or 0) * (seq_len or 0)
        head_unsupported = HeadTiling.unsupported(self.model) if head_tiling else ""
        if head_tiling and not head_unsupported and tokens < 4:
            head_unsupported = "the profiled batch's shape is unknown or under 4 tokens"
        measure_head = head_tiling and not head_unsupported
        mlp_unsupported = self._mlp_unsupported(tokens) if mlp_tiling else ""
        measure_mlp = mlp_tiling and not mlp_unsupported
        # Warm-up is hooked when streaming (the model cannot run without), and so is its
        # one plain pass: the streaming hooks alone, its uploads timed and taken out.
        hooked_passes = (4 if self.stream else 2) + (2 if measure_head else 0) + (3 if measure_mlp else 0)
        self.bar = tqdm(total=hooked_passes * 2 * len(self.blocks), desc="protrain: profiling",
                        unit="block", disable=not self.progress, leave=False)
        stats = [_PartStats() for _ in range(self.n_parts)]
        try:
            self.bar.set_postfix_str("warm-up")
            with _CallOrder(self.blocks) as calls:
                self._pass(hooks=self.stream)
            self._in_call_order(calls)
            # Best of the un-hooked iterations: the steady-state time the hooked part times
            # are rescaled to.
            self.bar.set_postfix_str("plain")
            plain_time = np.inf
            for _ in range(1 if self.stream else 2):
                loads: list = []
                self.clock.sync()
                t0 = time.perf_counter()
                self._pass(hooks=self.stream, loads=loads)
                self.clock.sync()
                plain_time = min(plain_time, time.perf_counter() - t0 -
                                 sum(self.clock.elapsed(a, b) for a, b in loads))
            self.bar.set_postfix_str("timing")
            attention = AttentionTimer(self.clock, lambda: self.state)
            with attention:
                marks = self._pass(hooks=True, timing=True, stats=stats)
            self._times_from_marks(marks, stats)
            self.bar.set_postfix_str("memory")
            kept = KeptBytes(lambda: self.state)
            ops, order, uses = self._memory_pass(stats, kept)
            tiled = []
            if measure_head:
                self.bar.set_postfix_str("tiled head")
                tiled, head_unsupported = self._tiled_head_passes(tokens)
            tiled_mlp, with_norm = [], False
            if measure_mlp:
                self.bar.set_postfix_str("tiled MLP")
                tiled_mlp, with_norm, mlp_unsupported = self._tiled_mlp_passes(tokens)
        finally:
            self.bar.close()
        hooked = sum(s.fwd_time + s.bwd_time for s in stats)
        slowdown = hooked / plain_time if plain_time > 0 and hooked > 0 else 1.0
        records = self._param_records(order, uses)
        names = self._block_names()
        attn_fwd, attn_bwd = attention.times()
        parts = []
        for k, s in enumerate(stats):
            kind = "pre" if k == 0 else "post" if k == self.n_parts - 1 else "block"
            fwd, bwd = s.fwd_time / slowdown, s.bwd_time / slowdown
            parts.append(PartProfile(
                name={"pre": "<pre>", "post": "<post>"}.get(kind) or names[k - 1], kind=kind,
                param_numel=sum(r.numel for r in records if r.parts[0] == k),
                fwd_time=fwd, bwd_time=bwd,
                in_bytes=s.in_bytes, saved_bytes=s.saved_bytes, fwd_start=s.fwd_start,
                fwd_peak=max(s.fwd_peak, s.fwd_start), bwd_start=s.bwd_start,
                bwd_peak=max(s.bwd_peak, s.bwd_start), kept_bytes=s.kept_bytes,
                resaved_bytes=s.resaved_bytes, in_shared_bytes=s.in_shared_bytes,
                attn_fwd_time=min(attn_fwd.get(k, 0.0) / slowdown, fwd),
                attn_bwd_time=min(attn_bwd.get(k, 0.0) / slowdown, bwd),
                attn_io_bytes=attention.io_bytes.get(k, 0),
                # The selective mode keeps the block input (as CKPT does) and the kept
                # operators' outputs; a block without them cannot run it.
                sel_saved_bytes=s.in_bytes + kept.bytes[k] if kind == "block" and kept.bytes.get(k) else 0))
        return ModelProfile(
            name=name, source="measured", device=str(self.device),
            param_bytes=self.params[0].element_size(), params=tuple(records), parts=tuple(parts),
            micro_batch=micro_batch, seq_len=seq_len, hooked_slowdown=slowdown, ops=tuple(ops),
            heads=attention.heads, kv_heads=attention.kv_heads, inplace_blocks=self.inplace_blocks,
            head=_head_profile(stats, tiled, tokens, parts[-1].fwd_time) if tiled else None,
            head_unsupported=head_unsupported or "",
            mlp=_mlp_profile(stats, tiled_mlp, tokens, parts, self._mlp_share(with_norm), with_norm) if tiled_mlp else None,
            mlp_unsupported=mlp_unsupported or "")

    def _tiled_head_passes(self, tokens: int) -> tuple[list, str]:
        """The post part's statistics from memory passes with the head and loss over tiles of
        half and a quarter of the batch's tokens: [(tile, stats), ...], or [] and why the head
        cannot be tiled after all (the model transforms its logits, computes no loss, ...)."""
        from ..runtime.tiled_head import HeadTiling, TiledHeadError
        out = []
        for tile in (-(-tokens // 2), -(-tokens // 4)):
            stats = [_PartStats() for _ in range(self.n_parts)]
            tiling = HeadTiling(self.model, tile)
            try:
                with tiling.active():
                    self._memory_pass(stats)
            except TiledHeadError as e:
                return [], str(e)
            if tiling.forwards == 0:
                return [], "the profiled step computed no loss through the model's loss function"
            out.append((tile, stats))
        return out, ""

    def _mlp_unsupported(self, tokens: int) -> str:
        """Why the blocks' MLPs cannot be tiled (empty: they can)."""
        from ..runtime.tiled_mlp import TiledMLPError, find_mlps, unsupported
        if tokens < 16:
            return "the profiled batch's shape is unknown or under 16 tokens"
        if not self.blocks:
            return "the model has no transformer blocks"
        try:
            mlps = find_mlps(self.blocks)
        except TiledMLPError as e:
            return str(e)
        return next((why for why in map(unsupported, mlps) if why), "")

    def _mlp_share(self, with_norm: bool = False) -> float:
        """Of a block's forward outside attention, the MLP's share (with its pre-norm's): its
        share of the block's parameters (matrix products' FLOPs go with their weights)."""
        from ..runtime.tiled_mlp import find_mlps, find_pre_norms
        block = self.blocks[0]
        mods = find_mlps([block]) + (find_pre_norms([block]) if with_norm else [])
        total = sum(p.numel() for p in block.parameters())
        return sum(p.numel() for m in mods for p in m.parameters()) / total if total else 0.0

    def _loss(self, grad: bool) -> tuple[torch.Tensor, list]:
        """The model's loss on the profiled batch from the profiled RNG and buffers (forward
        only), and the random generators' states after it."""
        self.rng.restore()
        self.module_state.restore_buffers()
        with torch.set_grad_enabled(grad):
            loss = self.step(self.model).detach().float().clone()
        states = [torch.get_rng_state()]
        if self.device.type == "cuda":
            states.append(torch.cuda.get_rng_state(self.device))
        return loss, states

    def _norm_fusable(self) -> bool:
        """Whether each block's MLP's pre-norm can run inside the MLP's tiles
        (tiled_mlp.MLPTiling ``with_norm``): the blocks have one, and the model's loss with it
        fused equals its own bit for bit (under no_grad, where the fused MLP computes
        mlp(norm(x)) in one piece: the same operators on the same tensors) - so the norm's
        output goes to the MLP and nowhere else. Not tried while streaming parameters."""
        from ..runtime.tiled_mlp import MLPTiling, TiledMLPError, find_pre_norms
        if self.stream or find_pre_norms(self.blocks) is None:
            return False
        own, _ = self._loss(grad=False)
        try:
            with MLPTiling(self.blocks, 1 << 62, with_norm=True).active():
                fused, _ = self._loss(grad=False)
        except TiledMLPError:
            return False
        return bool(torch.isfinite(own).all()) and torch.equal(own, fused)

    def _tiles_change_nothing(self, tile: int, with_norm: bool) -> str:
        """Why tiling the MLPs changes the model (empty: it does not): the forward's loss with
        them tiled against its own - the random generators left in another state (the MLP
        draws random numbers: functional dropout, whose recompute per tile would draw other
        masks) or the loss beyond rounding (an MLP that mixes tokens: a norm over the batch)."""
        from ..runtime.forward_patches import ForwardPatches
        from ..runtime.tiled_mlp import MLPTiling, find_mlps
        drew = []

        def states():
            out = [torch.get_rng_state()]
            if self.device.type == "cuda":
                out.append(torch.cuda.get_rng_state(self.device))
            return out

        def watched(forward):
            def run(*args, **kwargs):
                before = states()
                try:
                    return forward(*args, **kwargs)
                finally:
                    drew.append(not all(torch.equal(a, b) for a, b in zip(before, states())))
            return run
        with ForwardPatches() as patches:
            for mlp in find_mlps(self.blocks):
                patches.replace(mlp, watched(mlp.forward))
            own, _ = self._loss(grad=True)
        if any(drew):
            return "the MLPs draw random numbers (dropout), which a recompute per tile would draw again differently"
        with MLPTiling(self.blocks, tile, with_norm=with_norm).active():
            tiled, _ = self._loss(grad=True)
        tol = 1e-4 if self.params[0].element_size() >= 4 else 2e-2
        if not bool(torch.isfinite(own).all()) or not torch.allclose(tiled, own, rtol=tol, atol=0.0):
            return (f"the loss with the MLPs over tiles ({tiled.item():.6g}) is not the model's own "
                    f"({own.item():.6g}): the MLPs mix tokens")
        return ""

    def _tiled_mlp_passes(self, tokens: int) -> tuple[list, bool, str]:
        """The parts' statistics from memory passes with every block's MLP over tiles of a half,
        a quarter and an eighth of the batch's tokens: [(tile, stats), ...], longest first;
        whether the MLPs' pre-norms ran inside the tiles (``_norm_fusable``); and why the MLPs
        cannot be tiled after all ([] then): the tiled MLP changed the loss, or failed on this
        model (an MLP called with more than one tensor, or one that needs its input's batch
        and sequence dimensions)."""
        from ..runtime.tiled_mlp import MLPTiling
        tiles = (-(-tokens // 2), -(-tokens // 4), -(-tokens // 8))
        try:
            with_norm = self._norm_fusable()
            why = self._tiles_change_nothing(tiles[-1], with_norm)
            if why:
                return [], False, why
            out = []
            for tile in tiles:
                stats = [_PartStats() for _ in range(self.n_parts)]
                with MLPTiling(self.blocks, tile, with_norm=with_norm).active():
                    self._memory_pass(stats)
                out.append((tile, stats))
        except Exception as e:  # noqa: BLE001 - a model the tiles do not fit plans with its own MLPs
            return [], False, f"the tiled MLP failed on the profiled batch ({type(e).__name__}: {str(e)[:200]})"
        return out, with_norm, ""

    def _in_call_order(self, calls: "_CallOrder") -> None:
        """Put the blocks in the order the warm-up ran them (the part boundaries, and the
        runtime after them, take a block list in that order: top-level modules are listed as
        declared, not as called); blocks it never ran go last. A list naming a module at
        several positions (shared weights) is taken as listed: the part boundaries check the
        order. A block called again after another one cannot be one part: BlockOrderError."""
        names = self._block_names()
        self.inplace_blocks = tuple(names[i] for i in sorted(calls.mutated))
        if len({id(b) for b in self.blocks}) < len(self.blocks):
            return
        seen: set[int] = set()
        for k, i in enumerate(calls.calls):
            if i in seen:
                prev = calls.calls[k - 1]
                raise BlockOrderError(
                    f"ProTrain: block {names[i]} (position {i}) was called again after block "
                    f"{names[prev]} (position {prev}) in one forward pass: a block called after a "
                    f"later one cannot be a part of its own (its weights, gradients and saved "
                    f"activations are let go once its part is left; for layers shared in a loop, "
                    f"list one entry per call: nn.ModuleList([l0, l1] * k))")
            seen.add(i)
        if calls.calls == sorted(calls.calls):
            return        # in list order, some perhaps skipped (LayerDrop): as listed
        # Called out of the list's order (modules declared in another order than the forward
        # calls them): that order, each block the warm-up skipped after the one listed before it.
        order = list(calls.calls)
        for i in range(len(self.blocks)):
            if i not in order:
                before = [k for k, j in enumerate(order) if j < i]
                order.insert(before[-1] + 1 if before else 0, i)
        if self.streamer is not None:
            raise BlockOrderError(f"ProTrain: the blocks ran in another order than listed ("
                                  f"{', '.join(names[i] for i in calls.calls[:4])}, ...) while "
                                  f"their parameters were streamed")
        self.blocks = [self.blocks[i] for i in order]
        self.block_of_param = {}
        for i, b in enumerate(self.blocks):
            for p in b.parameters():
                self.block_of_param.setdefault(p, i)

    def _block_names(self) -> list[str]:
        return position_names(self.model, self.blocks)

    # ---- one iteration with the requested instrumentation ------------------------------
    def _pass(self, *, hooks: bool, timing: bool = False, stats=None, on_boundary=None,
              ledger: _SaveLedger | None = None, loads=None):
        """Run forward + backward. Returns the timing marks [(phase, part, clock mark)]; a
        "load" mark starts the upload of streamed weights, which belongs to no part. ``loads``
        receives the (start, end) clock marks of every upload."""
        self.rng.restore()
        self.module_state.restore_buffers()
        marks: list[tuple[str, int, object]] = []

        n_blocks = len(self.blocks)

        def boundary(phase: str, part: int, x: torch.Tensor | None = None):
            # Entering a part releases the block just left and brings in the one entered. The
            # upload is queued on the compute stream between two marks, so it is timed as
            # neither the part left nor the part entered.
            if self.streamer is not None:
                if self.registry is not None:
                    self.registry.paused = True
                start = self.clock.mark() if timing or loads is not None else None
                if timing:
                    marks.append(("load", part, start))
                left = self.state[1]    # not always the neighbour: a block called again re-enters
                if 1 <= left <= n_blocks:
                    self.streamer.unload(left - 1)
                if 1 <= part <= n_blocks:
                    self.streamer.load(part - 1)
                if loads is not None:
                    loads.append((start, self.clock.mark()))
                if self.registry is not None:
                    self.registry.paused = False
                self._refresh_param_ptrs()
            if phase == "fwd" and x is not None and stats is not None and part > 0:
                stats[part].in_bytes = storage_bytes(x)
                self.part_input[part] = storage_ptr(x)
                if ledger is not None:
                    ledger.entered(part, x)
            if phase == "bwd" and ledger is not None and part == self.n_parts - 1:
                ledger.finish(stats)
            self.state = (phase, part)
            if timing:
                marks.append((phase, part, self.clock.mark()))
            if on_boundary is not None:
                on_boundary(phase, part)
            if 0 < part < self.n_parts - 1:
                self.bar.update(1)

        self.state = ("fwd", -1)
        with ExitStack() as stack:
            if hooks:
                bounds = stack.enter_context(part_boundaries(self.blocks, boundary, self._block_names()))
                bounds.begin_forward()   # refuse blocks called out of order at the first forward
            if self.streamer is not None or on_boundary is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(
                    *self._saved_hooks(stats if ledger is not None else None, ledger)))
            stack.enter_context(drop_param_grads(self.params))
            if hooks:
                boundary("fwd", 0)
            loss = self.step(self.model)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError("profile_model: step(model) must return the scalar loss tensor, "
                                f"got {type(loss).__name__}")
            if hooks:
                boundary("bwd", self.n_parts - 1)
            loss.backward()
            del loss
            if hooks:
                if timing:
                    marks.append(("end", -1, self.clock.mark()))
                self.state = ("end", -1)
        self.clock.sync()
        return marks

    def _times_from_marks(self, marks, stats) -> None:
        self.clock.sync()
        for (phase, part, a), (_, _, b) in zip(marks, marks[1:]):
            dt = self.clock.elapsed(a, b)
            if phase == "fwd":
                stats[part].fwd_time += dt
            elif phase == "bwd":
                stats[part].bwd_time += dt

    def _memory_pass(self, stats, kept=None):
        if self.streamer is not None:
            for i in list(self.streamer.loaded):
                self.streamer.unload(i)
        self.registry = StorageRegistry(self.device.type)
        # Which part allocated each storage: a tensor an earlier part made and a block saves
        # (rotary cos/sin that every layer reads) is not freed by that block's mode, so it
        # counts where it was made (see _saved_hooks).
        register = self.registry.register

        def register_with_part(t, register=register):
            new = t.device.type == self.device.type and not self.registry.contains(t)
            register(t)
            if new and self.state[0] == "fwd":
                self.created[storage_ptr(t)] = self.state[1]     # an address may be reused
        self.registry.register = register_with_part
        self.meter = (AllocatorMeter(self.device) if self.device.type == "cuda"
                      else StorageMeter(self.registry))
        ops: list[OpRecord] = []
        prev_after = [0]
        order: list[int] = []
        uses: dict[int, list[int]] = {}

        entered = set()

        def on_boundary(phase, part):
            live = self.meter.live()
            s = stats[part]
            if phase == "fwd":
                # A block called again right after itself re-enters its part: it starts where
                # its first call did.
                s.fwd_start = s.fwd_start if part in entered else live
                s.fwd_peak = max(s.fwd_peak, live)
                entered.add(part)
            else:
                s.bwd_start, s.bwd_peak = live, max(s.bwd_peak, live)

        def on_op(name, before, peak, after):
            phase, part = self.state
            if phase == "fwd":
                stats[part].fwd_peak = max(stats[part].fwd_peak, peak)
            elif phase == "bwd":
                stats[part].bwd_peak = max(stats[part].bwd_peak, peak)
            else:
                return
            if self.device.type == "cuda":
                ops.append(OpRecord(name=name, part=part, phase=phase, live_before=before,
                                    intra_peak=peak - before, inter_delta=before - prev_after[0]))
            prev_after[0] = after

        def on_param_use(idx):
            phase, part = self.state
            if phase != "fwd":
                return
            lst = uses.get(idx)
            if lst is None:
                order.append(idx)
                uses[idx] = [part]
            elif lst[-1] != part:
                lst.append(part)

        self._refresh_param_ptrs()
        recorder = OpRecorder(self.registry, self.meter, on_op, self.param_of_ptr, on_param_use)
        try:
            with recorder, (kept if kept is not None else nullcontext()):
                self._pass(hooks=True, stats=stats, on_boundary=on_boundary, ledger=_SaveLedger())
        finally:
            self.registry = None
            self.meter = None
        return ops, order, uses

    def _refresh_param_ptrs(self) -> None:
        self.param_of_ptr.clear()
        for p, i in self.param_index.items():
            if p.device == self.device:
                self.param_of_ptr[p.untyped_storage().data_ptr()] = i

    # ---- hooks -------------------------------------------------------------------------
    def _saved_hooks(self, stats, ledger: _SaveLedger | None = None):
        """One pack/unpack pair (saved-tensor hooks do not nest) that
        - counts, per part, the distinct storages autograd saves in forward that this
          iteration allocated (parameters and pre-existing tensors such as the batch are not
          activations), and notes every saver in ``ledger``, when ``stats`` is given;
        - replaces saved references to streamed parameters by placeholders, so dropping a
          block's device copy really frees it; unpacking takes the copy loaded for backward."""
        streamer = self.streamer

        def pack(t):
            ptr = storage_ptr(t)
            idx = self.param_of_ptr.get(ptr) if t.device == self.device else None
            if stats is not None and idx is None and self.state[0] == "fwd" \
                    and self.registry is not None and self.registry.contains(t):
                part = self.state[1]
                # A storage an earlier part made (rotary cos/sin every layer is handed) is
                # owned there: a block's mode cannot free it (checkpoint holds it as an input).
                owner = part if ptr == self.part_input.get(part) else min(part, self.created.get(ptr, part))
                if ledger.saved(part, ptr, storage_bytes(t), owner):
                    stats[owner].saved_bytes += storage_bytes(t)
            if streamer is not None and idx is not None and self.params[idx] in streamer.home:
                return ("protrain-param", self.params[idx], t.size(), t.stride(), t.storage_offset())
            return t

        def unpack(obj):
            if isinstance(obj, tuple) and obj[0] == "protrain-param":
                _, p, size, stride, offset = obj
                return p.data.as_strided(size, stride, offset)
            return obj

        return pack, unpack

    # ---- results -----------------------------------------------------------------------
    def _param_records(self, order: list[int], uses: dict[int, list[int]]) -> list[ParamRecord]:
        names = {p: n for n, p in self.model.named_parameters()}
        post = self.n_parts - 1

        def parts_of(i: int) -> tuple[int, ...]:
            if uses.get(i):
                return tuple(uses[i])
            b = self.block_of_param.get(self.params[i])     # never used: its block, else the tail
            return (b + 1,) if b is not None else (post,)
        # A parameter this forward never used (an expert no token reached in the profiled
        # batch, a pooler) is packed with its block, before the first parameter of a later
        # part: at the tail it would share a chunk with the head, a chunk then used by parts
        # that are not adjacent (kept persistent, with every chunk before it) and far from
        # the rest of its block (whose part must then hold every chunk in between at once).
        placed = list(order)
        seen = set(order)
        for i in range(len(self.params)):
            if i not in seen:
                home = parts_of(i)[0]
                at = next((k for k, j in enumerate(placed) if parts_of(j)[0] > home), len(placed))
                placed.insert(at, i)
        return [ParamRecord(name=names.get(self.params[i], f"param{i}"), numel=self.params[i].numel(),
                            parts=parts_of(i)) for i in placed]


def _head_profile(parts: list, tiled: list, tokens: int, head_fwd_time: float) -> HeadProfile:
    """HeadProfile from the parts untiled and at two tile lengths: per figure of the post part,
    the change per token of one tile (the difference between the two tilings) and per token of
    the batch (what remains of the difference to the untiled head); the levels through the
    earlier parts' backward from the last of them. The recompute in backward is priced as the
    post part's forward (its norm included: a slight over-estimate)."""
    (t1, all_a), (t2, all_b) = tiled
    untiled, a, b = parts[-1], all_a[-1], all_b[-1]
    held = max(all_a[-2].bwd_start - parts[-2].bwd_start, all_b[-2].bwd_start - parts[-2].bwd_start) \
        if len(parts) > 2 else 0

    def fwd(s):
        return max(s.fwd_peak, s.fwd_start)

    def bwd(s):
        return max(s.bwd_peak, s.bwd_start)

    fwd_tile = max(fwd(a) - fwd(b), 0) / (t1 - t2)
    bwd_tile = max(bwd(a) - bwd(b), 0) / (t1 - t2)
    return HeadProfile(
        saved_per_token=(a.saved_bytes - untiled.saved_bytes) / tokens,
        fwd_peak_per_token=(fwd(a) - fwd_tile * t1 - fwd(untiled)) / tokens,
        fwd_peak_per_tile_token=fwd_tile,
        bwd_start_per_token=(a.bwd_start - untiled.bwd_start) / tokens,
        bwd_peak_per_token=(bwd(a) - bwd_tile * t1 - bwd(untiled)) / tokens,
        bwd_peak_per_tile_token=bwd_tile,
        bwd_time_per_token=head_fwd_time / tokens, held_per_token=min(held, 0) / tokens)


def _mlp_profile(untiled: list, tiled: list, tokens: int, parts: list, mlp_share: float,
                 with_norm: bool = False) -> MLPProfile:
    """MLPProfile from the blocks untiled and with their MLPs at several tile lengths (longest
    first): per figure, a line in the tile length on or above every measured point of every
    block - the steepest slope between neighbouring lengths (a ragged last tile or a transient
    of another op makes the excursion bend), through the highest point - as a change per token
    of one tile and per token of the batch (from the untiled block); the saved bytes' change of
    the block that saves the most. The recompute in backward is priced as the MLP's share of
    the block's forward outside attention."""
    a = tiled[0][1]
    blocks = [k for k, p in enumerate(parts) if p.kind == "block"]

    def fwd(s):
        return max(s.fwd_peak, s.fwd_start) - s.fwd_start

    def bwd(s):
        return max(s.bwd_peak, s.bwd_start) - s.bwd_start

    def fit(exc):
        tile = max([0.0] + [(exc(s1[k]) - exc(s2[k])) / (t1 - t2) for k in blocks
                            for (t1, s1), (t2, s2) in zip(tiled, tiled[1:])])
        return tile, max((exc(s[k]) - tile * t - exc(untiled[k])) / tokens for k in blocks for t, s in tiled)

    fwd_tile, fwd_token = fit(fwd)
    bwd_tile, bwd_token = fit(bwd)
    mlp_fwd = max(mlp_share * (parts[k].fwd_time - parts[k].attn_fwd_time - parts[k].comm_fwd_time)
                  for k in blocks)
    return MLPProfile(
        saved_per_token=max((a[k].saved_bytes - untiled[k].saved_bytes) / tokens for k in blocks),
        fwd_peak_per_token=fwd_token, fwd_peak_per_tile_token=fwd_tile,
        bwd_peak_per_token=bwd_token, bwd_peak_per_tile_token=bwd_tile,
        bwd_time_per_token=max(mlp_fwd, 0.0) / tokens, shortest_tile=tiled[-1][0] / tokens,
        with_norm=with_norm)


def storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


@contextmanager
def drop_param_grads(params):
    """Parameter gradients are model states (modelled from the chunk layout), not
    activations: drop each as soon as it is accumulated, as the runtime does when it moves it
    into its chunk."""
    handles = [p.register_post_accumulate_grad_hook(_clear_grad) for p in params]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _clear_grad(p: torch.Tensor) -> None:
    p.grad = None


class _CallOrder:
    """The blocks one forward calls, in order (one entry per call; a block's calls that follow
    one another count once: it stays in its part), and those that change an input in place."""

    def __init__(self, blocks: Sequence[nn.Module]):
        self.blocks = blocks
        self.calls: list[int] = []
        self.mutated: set[int] = set()
        self.handles: list = []
        self._versions: dict[int, list] = {}

    def __enter__(self) -> "_CallOrder":
        for i, b in {id(b): (i, b) for i, b in reversed(list(enumerate(self.blocks)))}.values():
            self.handles.append(b.register_forward_pre_hook(
                lambda m, a, k, i=i: self._ran(i, a, k), with_kwargs=True))
            self.handles.append(b.register_forward_hook(lambda m, a, out, i=i: self._done(i)))
        return self

    def _ran(self, i: int, args, kwargs) -> None:
        if torch._C._current_graph_task_id() != -1:      # a recompute in backward
            return
        self._versions[i] = [(t, version(t)) for t in tensors_in((args, kwargs))]
        if not self.calls or self.calls[-1] != i:
            self.calls.append(i)

    def _done(self, i: int) -> None:
        if any(version(t) != v for t, v in self._versions.pop(i, ())):
            self.mutated.add(i)

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


class _RngState:
    def __init__(self, device: torch.device):
        self.cpu = torch.random.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" else None

    def restore(self) -> None:
        torch.random.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
