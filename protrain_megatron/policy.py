"""ActivationPolicy: run a plan's per-layer block modes on a megatron-core model.

Two ways, chosen from the plan:

- native: every layer kept, or the first N recomputed. Megatron does this itself with
  ``recompute_granularity="full"``, ``recompute_method="block"``, ``recompute_num_layers=N``
  (read at forward time, so setting them on the built model's config is enough).
- hooks: anything else (swap to host, NVMe, checkpointed layers that are not a prefix).
  Megatron's recompute is switched off and ProTrain's ActivationRuntime is driven from the
  layers' part boundaries: CKPT layers run under torch's non-reentrant checkpoint with
  Megatron's tensor-parallel RNG streams restored (``rng.tracker_context_fn``) and run to
  the end of the layer's forward, as Megatron's own recompute runs them (``_wrap_forward``),
  SWAP / SSD layers' saved tensors go through saved-tensor hooks entered around the model's
  forward. Megatron's parameters never move, so saved views of them are kept as they are.

``close()`` restores the model: the config fields, the layers' forwards, the hooks.
"""
from __future__ import annotations

import functools
from contextlib import ExitStack
from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop

from protrain.block_mode import BlockMode, modes_string
from protrain.plan import Plan
from protrain.runtime.meter import storage_ptr
from protrain.runtime.activations import ActivationRuntime
from protrain.runtime.boundaries import first_tensor, part_boundaries
from protrain.runtime.runtime import DeviceAccounting
from protrain.runtime.streams import Streams

from .model import decoder_layers, global_layer_numbers, model_device, unwrap
from .rng import tracker_context_fn

RECOMPUTE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers")


def native_recompute_layers(modes: Sequence[BlockMode]) -> int | None:
    """N if Megatron can run ``modes`` itself (the first N layers recomputed, the rest kept),
    else None."""
    n = sum(m == BlockMode.CKPT for m in modes)
    if all(m == (BlockMode.CKPT if i < n else BlockMode.NONE) for i, m in enumerate(modes)):
        return n
    return None


class ActivationPolicy:
    def __init__(self, model: nn.Module | Sequence[nn.Module], plan: Plan, *,
                 ssd_path: str | None = None, ssd_verify: bool = False, ssd_min_bytes: int = 2**20,
                 accounting: bool = False, native: bool = True, pipeline_parallel: int = 1):
        """Apply ``plan.block_modes`` to the layers of ``model`` (this rank's pipeline stage).
        ``native=False`` forces the hooks even where Megatron's own recompute could do it.
        ``accounting`` counts the activation bytes allocated per iteration (CPU tests)."""
        self.core = unwrap(model)
        self.layers = decoder_layers(self.core)
        self.plan = plan
        modes = tuple(plan.block_modes)
        if len(modes) != len(self.layers):
            raise ValueError(f"protrain: the plan has {len(modes)} layer modes but this rank runs "
                             f"{len(self.layers)} layers; it was made for another model or pipeline "
                             f"split (delete the plan file to re-plan)")
        offloads = [i for i, m in enumerate(modes) if m in (BlockMode.SWAP, BlockMode.SSD)]
        if offloads and pipeline_parallel > 1:
            raise ValueError("protrain: swapping or NVMe-offloading layers needs one micro-batch in "
                             "flight, but pipeline parallelism keeps several; plan with n_swap=0 "
                             "and n_ssd=0 (the Megatron adapter does this) or use "
                             "--pipeline-model-parallel-size 1")
        self.device = model_device(self.core)
        self.layer_numbers = global_layer_numbers(self.layers)
        self._configs = _configs(self.core)
        self._saved = [{f: getattr(c, f) for f in RECOMPUTE_FIELDS} for c in self._configs]
        if any(getattr(c, "cpu_offloading", False) for c in self._configs):
            raise ValueError("protrain: the model was built with Megatron's cpu_offloading; the plan "
                             "decides what goes to host memory - drop --cpu-offloading(-num-layers)")
        n = native_recompute_layers(modes) if native else None
        reason = native_only_reason(self.core)
        if n is None and reason:
            raise ValueError(f"protrain: plan {modes_string(modes)} needs ProTrain's layer hooks, but "
                             f"{reason}, where only Megatron's own recompute of the first layers is "
                             f"safe; pin n_swap=0 and n_ssd=0 (plan_activations does this) and re-plan")
        self.native = n is not None
        self.activations: ActivationRuntime | None = None
        self.accounting = DeviceAccounting(self.device) if accounting else None
        self._stack = ExitStack()
        self._in_backward = False
        if self.native:
            self._set_recompute("full", "block", n) if n else self._set_recompute(None, None, None)
            if self.accounting is not None:
                self._wrap_forward(hooks=False)
            return
        self._set_recompute(None, None, None)
        params = [p for p in self.core.parameters()]
        self._param_ptrs = {storage_ptr(p) for p in params}
        self.activations = ActivationRuntime(
            self.layers, modes, Streams(self.device), self.device, plan.block_saved_bytes,
            self._param_lookup, ssd_root=ssd_path, ssd_verify=ssd_verify, ssd_min_bytes=ssd_min_bytes,
            checkpoint_context_fn=tracker_context_fn)
        self._stack.callback(self.activations.close)
        self._stack.enter_context(part_boundaries(self.layers, self._on_enter))
        self._wrap_forward(hooks=bool(offloads))

    # ---- what was applied --------------------------------------------------------------------
    @property
    def how(self) -> str:
        if self.native:
            c = self._configs[0]
            if c.recompute_granularity is None:
                return "Megatron config: no recompute (every layer keeps its activations)"
            return (f"Megatron config: recompute_granularity=full, recompute_method=block, "
                    f"recompute_num_layers={c.recompute_num_layers}")
        return f"ProTrain hooks on decoder.layers ({modes_string(self.plan.block_modes)})"

    def layer_table(self) -> list[tuple[int, BlockMode]]:
        """(global layer number, mode) for this rank's layers."""
        return list(zip(self.layer_numbers, self.plan.block_modes))

    @property
    def storage_backend(self) -> str | None:
        return self.activations.storage_backend if self.activations is not None else None

    def activation_peak(self) -> int:
        """Highest activation bytes counted (accounting mode), over the iterations so far."""
        if self.accounting is None:
            raise RuntimeError("activation_peak() needs ActivationPolicy(..., accounting=True)")
        self.accounting.end(0)
        return self.accounting.activation_peak

    def reset_peak(self) -> None:
        """Forget the peaks counted so far (e.g. a first iteration that allocated gradients)."""
        if self.accounting is not None:
            self.accounting.end(0)
            self.accounting.activation_peak = self.accounting.peak = 0

    # ---- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Undo everything; the model runs as it was built."""
        if self.accounting is not None:
            self.accounting.end(0)
        self._stack.close()
        for c, saved in zip(self._configs, self._saved):
            for f, v in saved.items():
                setattr(c, f, v)
        self.activations = None

    def _set_recompute(self, granularity, method, layers) -> None:
        for c in self._configs:
            c.recompute_granularity, c.recompute_method, c.recompute_num_layers = granularity, method, layers

    def _wrap_forward(self, hooks: bool) -> None:
        core = self.core
        original = core.__dict__.get("forward")
        inner = core.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            if not (torch.is_grad_enabled() and core.training):
                return inner(*args, **kwargs)
            self._begin_iteration()
            with ExitStack() as stack:
                if self.activations is not None:
                    # Recompute CKPT / SELECTIVE layers to the end of their forward, as
                    # Megatron's own recompute does, not only up to the last tensor backward
                    # needs (torch's early stop): a layer may keep per-call state that its
                    # forward releases only at its end. megatron-core 0.19's TransformerLayer
                    # sets self.mlp_norm_manager, which holds the residual, in
                    # _forward_pre_mlp_layernorm and clears it in _forward_post_mlp, after the
                    # last saved tensor. Stopped early, the recompute leaves it set, and the
                    # residual's autograd graph keeps what the recompute saved alive until the
                    # layer's next forward: a recomputed layer's activations, per layer, that the
                    # plan does not count. The tail has no FLOPs (the bias-dropout-add), and the
                    # planner times a recompute as a whole forward.
                    stack.enter_context(set_checkpoint_early_stop(False))
                if hooks:
                    stack.enter_context(self.activations.hooks())
                out = inner(*args, **kwargs)
            if self.activations is not None:
                self.activations.enter_forward_block(None)
            y = first_tensor(out if isinstance(out, (tuple, list)) else (out,))
            if y is not None and y.requires_grad:
                y.register_hook(self._output_grad)
            return out

        core.forward = forward

        def restore():
            if original is None:
                core.__dict__.pop("forward", None)
            else:
                core.forward = original
        self._stack.callback(restore)

    # ---- iteration events -------------------------------------------------------------------
    def _begin_iteration(self) -> None:
        if self._in_backward:
            self._end_iteration()
        if self.activations is not None:
            self.activations.reset()
        if self.accounting is not None:
            self.accounting.end(0)
            self.accounting.begin()

    def _output_grad(self, grad):
        # Backward starts at the model's output: bring the last layer's tensors back.
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_iteration)
            if self.activations is not None:
                self.activations.backward_start()
        return grad

    def _end_iteration(self) -> None:
        self._in_backward = False
        if self.activations is not None:
            self.activations.reset()
        if self.accounting is not None:
            self.accounting.stop()

    def _on_enter(self, phase: str, part: int, tensor) -> None:
        if phase == "fwd":
            self.activations.forward_part(part)
        else:
            self.activations.backward_done_with(part)
            self.activations.backward_prefetch(part)

    def _param_lookup(self, t: torch.Tensor):
        # Megatron's parameters (and its contiguous parameter buffers) stay where they are.
        return True if storage_ptr(t) in self._param_ptrs else None


def native_only_reason(core: nn.Module) -> str | None:
    """Why only Megatron's own recompute can run on this model (None: anything can):
    FP8/FP4 layers save Transformer Engine's quantized tensors and need its recompute; CUDA
    graphs capture a layer once and replay it without ProTrain's hooks."""
    for c in _configs(core):
        for attr, name in (("fp8", "FP8"), ("fp4", "FP4")):
            if getattr(c, attr, None):
                return f"the model trains in {name}"
        if getattr(c, "cuda_graph_impl", "none") not in (None, "none"):
            return f"it runs CUDA graphs (cuda_graph_impl={c.cuda_graph_impl!r})"
    return None


def _configs(core: nn.Module) -> list:
    """The TransformerConfig objects the model's recompute is read from (usually one shared)."""
    out = []
    for c in (getattr(core, "config", None), getattr(core.decoder, "config", None)):
        if c is not None and all(hasattr(c, f) for f in RECOMPUTE_FIELDS) and \
                not any(c is o for o in out):
            out.append(c)
    if not out:
        raise ValueError(f"protrain: {type(core).__name__} has no TransformerConfig with recompute "
                         f"fields; is it a megatron-core model?")
    return out
