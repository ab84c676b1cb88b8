"""Sequence parallelism (Ulysses) inside the DeepSpeed engine, for an unchanged script.

With a plan whose ``sequence_parallel`` P is above 1, every ``engine(batch)`` call of a rank:

1. gathers the micro-batches of its group of P ranks (protrain.sp.batch: gather and rotate);
2. runs them one after another, each split along the sequence over the group: forward with
   Ulysses attention in the blocks (protrain.sp.ulysses) and the group-weighted loss, then its
   backward right away, so one sub-step's activations are alive at a time. The sub-steps are
   gradient-accumulation micro-steps for the runtime (the plan was searched so);
3. returns the model's output with ``loss`` holding this rank's own micro-batch's loss (the
   same number a data-parallel run prints) - a value whose gradient has been taken already.

The sub-steps' backward needs the gradient the script will give the returned loss: DeepSpeed
divides it by the accumulation steps (and the fp16 loss scale multiplies it); the Hugging Face
Trainer multiplies it by the world size when it averages tokens across devices. The engine
applies DeepSpeed's factor, checks at the script's backward which factor the loss really
received, and if it differs at the first micro-step rescales that micro-step's gradients and
uses the factor from then on (it must stay constant: the loss may be scaled, not transformed).
Reading that gradient waits for the device, so after the first micro-step it stays there:
every micro-step's, and the device's verdict on each attention mask (all ones, or refused),
are read together once per optimizer step (``verify``), before the step applies anything.

Gradients: each rank's backward of its shards, summed over the group, is the gradient of the
micro-batches' losses; the chunks' reduce-scatter sums over all ranks and divides by the world
size, which averages over the data-parallel replicas exactly as DeepSpeed does.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.utils import register_output_backward_hooks

from protrain.runtime.tiled_head import is_hf_causal_lm
from protrain.sp.batch import PADDING_MASK, BatchExchange, ShardedLoss, shard
from protrain.sp.ulysses import SequenceParallelError, UlyssesSwitch, new_groups, ulysses_blocks

from . import accumulation


def model_takes(module, name: str) -> bool:
    """Whether the module's forward has a parameter ``name``. A wrapper whose forward passes
    **kwargs on to the model it wraps (PEFT's ``get_base_model()``) takes what that model
    takes; any other **kwargs is not enough (what its body does with them is unknown)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    if name in params:
        return True
    wrapped = getattr(module, "get_base_model", None)
    if callable(wrapped) and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        inner = wrapped()
        return inner is not module and model_takes(inner, name)
    return False


def unsupported_reason(module) -> str | None:
    """Why the engine cannot split this model's sequences (None: it can)."""
    if not model_takes(module, "position_ids"):
        return ("the model's forward takes no position_ids, so every sequence shard would restart "
                "its positions at 0; give forward a position_ids argument (Hugging Face models "
                "have one)")
    return None


class SequenceParallelForward:
    """The engine's forward (and the runtime's accumulation boundary) under a plan with P > 1."""

    def __init__(self, engine, degree: int, blocks):
        self.engine = engine
        self.degree = degree
        self.group, self.rank = new_groups(dist.get_world_size(), degree)
        # The batches' layouts are compared on the host, over gloo, without touching the device.
        nccl = dist.get_backend(self.group) == "nccl"
        host_group = new_groups(dist.get_world_size(), degree, backend="gloo")[0] if nccl else self.group
        self.exchange = BatchExchange(self.group, host_group, degree,
                                      engine.device if nccl else torch.device("cpu"),
                                      to_device=lambda t: engine.protrain_runtime.streams.to_device(t))
        self.switch = UlyssesSwitch()
        self._blocks = ulysses_blocks(blocks, self.group, degree, self.switch)
        self.modes = self._blocks.__enter__()
        module = engine.module
        self.shift_labels = is_hf_causal_lm(module)
        self.position_ids = model_takes(module, "position_ids")
        self.use_cache = model_takes(module, "use_cache")
        self.substep = degree - 1
        self.factor = None
        """Gradient the script gives the returned loss, over DeepSpeed's loss scale (learnt at
        the first micro-step; DeepSpeed's 1 / gradient_accumulation_steps until then)."""
        self._expected = None
        self._pending: list[tuple[torch.Tensor, object]] = []
        """Device values to check on the host once per step: (0-d tensor, check(value))."""

    @contextmanager
    def outside_forward(self):
        """A forward of the model that does not come through the engine (generate, module(x)):
        every rank holds its whole sequence, so plain attention (the Ulysses wrappers off).
        Training through it cannot be split over the sequence: refused by name."""
        if torch.is_grad_enabled() and self.engine.module.training:
            raise SequenceParallelError(
                f"a training forward of the model outside engine(...) (engine.module(x), "
                f"model(x)) under sequence parallelism (P={self.degree}): the engine splits each "
                f"sequence over the ranks, a direct call cannot. Call engine(batch) to train, or "
                f"set protrain.sequence_parallel to 1")
        with self.switch.off():
            yield

    def close(self) -> None:
        if self._blocks is not None:
            self._blocks.__exit__(None, None, None)
            self._blocks = None

    def is_boundary(self) -> bool:
        """Accumulation boundary for the runtime: DeepSpeed's, at the group's last sub-step."""
        return accumulation.is_boundary(self.engine) and self.substep == self.degree - 1

    # ---- one forward call of the script -------------------------------------------------------
    def forward(self, inputs, kwargs):
        eng = self.engine
        runtime = eng.protrain_runtime
        train = torch.is_grad_enabled() and eng.module.training
        factor = self.factor if self.factor is not None else 1.0 / eng.gradient_accumulation_steps()
        values, out = [], None
        for j, (a, k) in enumerate(self.exchange(inputs, kwargs)):
            self.substep = j
            a, k = shard(a, k, rank=self.rank, degree=self.degree, shift_labels=self.shift_labels,
                         position_ids=self.position_ids, check_mask=self._mask_later if train else None)
            if train and self.use_cache and "use_cache" not in k:
                k["use_cache"] = False      # a KV cache grows again when a block recomputes
            loss_mode = ShardedLoss(self.group)
            with runtime.forward_context(a, k), loss_mode:
                out = DeepSpeedEngine.forward(eng, *a, **k)
            if loss_mode.calls == 0:
                raise SequenceParallelError(
                    "sequence parallelism needs the model to compute its loss with "
                    "torch.nn.functional.cross_entropy inside forward (pass the labels): a loss "
                    "computed outside cannot be weighted over the sequence shards. Set "
                    "protrain.sequence_parallel to 1 otherwise")
            partial = _loss_of(out)
            value = partial.detach().clone()
            dist.all_reduce(value, group=self.group)
            values.append(value)
            if train:
                DeepSpeedEngine.backward(eng, partial * factor, scale_wrt_gas=False)
            del partial
            if j < self.degree - 1:
                out = None          # only the last sub-step's output is returned
        if sum(m.calls for m in self.modes) == 0:
            raise SequenceParallelError("sequence parallelism: the model's blocks never called "
                                        "torch.nn.functional.scaled_dot_product_attention; load a "
                                        "Hugging Face model with attn_implementation=\"sdpa\", or "
                                        "set protrain.sequence_parallel to 1")
        mine = values[self.rank]
        if train:
            mine = self._anchored(mine, factor)
        return _with_loss(out, mine)

    def _anchored(self, value: torch.Tensor, factor: float) -> torch.Tensor:
        """``value`` as a tensor the script can call backward on: the gradient reaching it says
        which factor the script applied (checked against the one the sub-steps used)."""
        eng = self.engine
        anchor = torch.zeros((), dtype=value.dtype, device=value.device, requires_grad=True)
        scale = eng.optimizer.cur_scale
        anchor.register_hook(lambda g: self._received(g, factor, scale))
        ret = anchor + value
        register_output_backward_hooks(ret, preprocess_once_fn=eng._backward_prologue,
                                       preprocess_per_tensor_fn=eng._backward_prologue_per_tensor)
        return ret

    def _received(self, g: torch.Tensor, used: float, scale: float) -> None:
        """Backward hook: the gradient the returned loss got. The first micro-step after a plan
        learns the factor from it now (one host read per plan); the others' are checked in
        ``verify``."""
        if self.factor is None:
            self._check_factor(float(self.engine.protrain_runtime.streams.to_host(g)), used, scale)
        else:
            self._pending.append((g.detach(), lambda got: self._check_factor(got, used, scale)))

    def _mask_later(self, ones: torch.Tensor) -> None:
        """``shard``'s check of a training batch's attention mask, read in ``verify``."""
        def check(all_ones: float) -> None:
            if all_ones != 1.0:
                raise SequenceParallelError(PADDING_MASK)
        self._pending.append((ones, check))

    def verify(self) -> None:
        """Before the optimizer step: the checks taken on the device since the last one, with
        one host read (each would have waited for the device where it was taken)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        values = torch.stack([v.reshape(()).to(torch.float64) for v, _ in pending])
        for got, (_, check) in zip(self.engine.protrain_runtime.streams.to_host(values).tolist(), pending):
            check(got)

    def _check_factor(self, got: float, used: float, scale: float) -> None:
        actual = got / scale
        if abs(actual - used) <= 1e-6 * abs(used):
            self.factor = used
            return
        optimizer = self.engine.protrain_runtime.optimizer
        if self.factor is None and optimizer.first_step_of_plan:
            # First micro-step after planning: nothing is applied yet, rescale and learn.
            optimizer.scale_gradients(actual / used)
            self.factor = actual
            return
        raise SequenceParallelError(
            f"sequence parallelism: the loss returned by forward reached backward scaled by "
            f"{actual:.6g} (after DeepSpeed's own scaling), but earlier micro-batches were "
            f"{used:.6g}; the gradients of a group's micro-batches are taken inside forward, so "
            f"the loss may only be multiplied by the same constant every step")


def _loss_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) \
            and out[0].numel() == 1:
        loss = out[0]
    if not isinstance(loss, torch.Tensor):
        raise SequenceParallelError("sequence parallelism needs the model to return its loss (pass "
                                    "the labels to forward)")
    return loss


def _with_loss(out, loss: torch.Tensor):
    """``out`` with its loss replaced (the other outputs are those of the last sub-step's
    shard of this rank)."""
    if isinstance(out, torch.Tensor):
        return loss
    if isinstance(out, dict):              # Hugging Face ModelOutput is a dict
        out["loss"] = loss
        return out
    if isinstance(out, tuple):
        return (loss,) + tuple(out[1:])
    if isinstance(out, list):
        return [loss] + list(out[1:])
    return loss
