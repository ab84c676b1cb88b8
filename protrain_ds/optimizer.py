"""ProTrainOptimizer: what DeepSpeed's engine sees as its (ZeRO) optimizer.

Subclassing DeepSpeed's ZeROOptimizer keeps the engine's own backward and step paths (loss
scaling, gradient accumulation boundaries, overflow bookkeeping, LR scheduling, direct
``loss.backward()``); the work is done by the framework-neutral chunk runtime.

The Adam hyper-parameters come from the DeepSpeed ``optimizer`` section or from a client
optimizer (torch Adam/AdamW, DeepSpeedCPUAdam, FusedAdam). A plain torch optimizer holds the
param groups (schedulers, DeepSpeed's and torch's, need one); it is never stepped itself.
"""
from __future__ import annotations

import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer

from protrain.config import ConfigError
from protrain.runtime.adam import AdamHyper
from protrain.runtime.options import OptimizerSetup

from . import accumulation
from .step_aside import client_optimizer_outside
from .trainable import step_rule

_OPTIMIZER_PARAM_KEYS = {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode",
                         "torch_adam", "amsgrad", "fp32_optimizer_states", "foreach"}
DEEPSPEED_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
"""The defaults of DeepSpeed's FusedAdam and DeepSpeedCPUAdam, which an "Adam"/"AdamW" section
gets without ``torch_adam`` (torch's AdamW would default weight_decay to 0.01)."""


def _torch_flags(opt) -> tuple[bool | None, bool | None] | None:
    """(fused, foreach) of a torch.optim Adam/AdamW (None for another optimizer). Settings the
    chunk runtime does not run never get here: ProTrain steps aside for them (step_aside.py)."""
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return None
    reason = client_optimizer_outside(opt)
    if reason is not None:
        raise ConfigError(f"protrain cannot run {reason}")
    groups = opt.param_groups or [opt.defaults]
    return groups[0].get("fused", opt.defaults.get("fused")), groups[0].get("foreach", opt.defaults.get("foreach"))


class ProTrainOptimizer(ZeROOptimizer):
    def __init__(self, engine, client_optimizer, model_parameters):
        super().__init__()
        self.engine = engine
        self.runtime = None
        self.custom_loss_scaler = False
        self.torch_autocast_gradscaler = None
        self.overflow = False
        self._global_grad_norm = None
        self.torch_adam = False
        if client_optimizer is None:
            self.optimizer, self.adamw, self.torch_adam = self._from_config(engine, model_parameters)
        else:
            opt = client_optimizer
            if not isinstance(opt, torch.optim.Optimizer) and callable(opt):
                opt = opt(model_parameters)
            self.optimizer, self.adamw = opt, self._adamw_of(opt)
            # Plain DeepSpeed steps a client torch Adam/AdamW itself: run torch's arithmetic
            # with its flags, not DeepSpeed's CPU Adam (the same bits as the script without us).
            self.torch_adam = _torch_flags(opt) is not None
        self.step_rule = step_rule(client_optimizer, self.torch_adam,
                                   engine.fp16_enabled() or engine.bfloat16_enabled())
        """How plain DeepSpeed's optimizer counts Adam steps (trainable.py): what a change of
        the trainable set carries over."""
        self.param_groups = self.optimizer.param_groups
        self.defaults = self.optimizer.defaults
        self.state = {}
        self.fp16 = engine.fp16_enabled()
        self.dynamic_loss_scale = self.fp16 and engine.dynamic_loss_scale()
        self.loss_scaler = None
        if self.fp16:
            from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
            self.loss_scaler = CreateLossScaler(dtype=torch.float16,
                                                static_loss_scale=engine.loss_scale(),
                                                dynamic_scaling=engine.dynamic_loss_scale(),
                                                dynamic_loss_args=engine.dynamic_loss_scale_args())

    # ---- configuration ---------------------------------------------------------------------
    @staticmethod
    def _from_config(engine, model_parameters):
        """The param-group holder DeepSpeed would build for the config's Adam/AdamW section,
        with DeepSpeed's defaults (``DeepSpeedEngine._configure_basic_optimizer``): its
        FusedAdam / DeepSpeedCPUAdam (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0,
        bias_correction true) unless ``torch_adam``, which takes torch's Adam/AdamW and its
        defaults (AdamW: weight_decay 0.01)."""
        params = dict(engine.optimizer_params() or {})
        for key in params:
            if key not in _OPTIMIZER_PARAM_KEYS:
                raise ConfigError(f"optimizer.params.{key} is not an Adam/AdamW setting ProTrain "
                                  f"knows; supported: {', '.join(sorted(_OPTIMIZER_PARAM_KEYS))}")
        name = engine.optimizer_name()
        # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
        adamw = name.lower() == "adamw" or params.pop("adam_w_mode", True)
        torch_adam = bool(params.pop("torch_adam", False))
        params.pop("amsgrad", None)          # true is refused with the section (config.py)
        params.pop("fp32_optimizer_states", None)
        params.pop("foreach", None)
        bias_correction = params.pop("bias_correction", True)
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        if not torch_adam:
            params = {**DEEPSPEED_ADAM_DEFAULTS, **params}
        shell = cls(model_parameters, **params)
        for g in shell.param_groups:
            g.setdefault("bias_correction", bias_correction)
        return shell, adamw, torch_adam

    @staticmethod
    def _adamw_of(opt) -> bool:
        if isinstance(opt, torch.optim.AdamW):
            return True
        if isinstance(opt, torch.optim.Adam):       # AdamW's arithmetic when decoupled
            return bool(opt.defaults.get("decoupled_weight_decay", False))
        for attr in ("adam_w_mode", "adamw_mode"):
            if hasattr(opt, attr):
                return bool(getattr(opt, attr))
        raise ConfigError(f"client optimizer {type(opt).__name__} is not supported with protrain: "
                          f"pass torch.optim.Adam/AdamW, DeepSpeedCPUAdam or FusedAdam, or describe "
                          f"it in the DeepSpeed config's optimizer section")

    def runtime_setup(self) -> OptimizerSetup:
        defaults = self.defaults
        adamw = self.adamw

        def hyper(group: dict) -> AdamHyper:
            b1, b2 = group.get("betas", defaults.get("betas", (0.9, 0.999)))
            return AdamHyper(lr=float(group["lr"]), beta1=b1, beta2=b2,
                             eps=group.get("eps", defaults.get("eps", 1e-8)),
                             weight_decay=group.get("weight_decay", defaults.get("weight_decay", 0.0)),
                             bias_correction=group.get("bias_correction", True), adamw=adamw)

        fused, foreach = _torch_flags(self.optimizer) or (None, None)
        return OptimizerSetup(param_groups=self.param_groups, hyper=hyper, adamw=adamw,
                              torch_adam=self.torch_adam, torch_fused=fused, torch_foreach=foreach,
                              grad_accumulation_steps=accumulation.planned_steps(self.engine),
                              clip=self.engine.gradient_clipping() or 0.0,
                              loss_scaler=self.loss_scaler)

    # ---- what the engine calls ---------------------------------------------------------------
    def backward_prologue(self, *args, **kwargs):
        if self.runtime is not None:
            self.runtime.begin_backward()
        if args:  # ZeROOptimizer.backward(loss) path: scale and return the loss
            return self.scale_if_loss(args[0])
        return None

    def backward_epilogue(self, **kwargs):
        if self.runtime is not None:
            self.runtime.finish_backward()

    def step(self, closure=None):
        if getattr(self.engine, "protrain_retired_by", None) is not None:
            from .handover import retired_error
            raise retired_error(self.engine, "engine.step()")
        if self.runtime is None:
            raise RuntimeError("engine.step() before any forward: ProTrain plans at the first "
                               "forward pass, so run engine(batch) and engine.backward(loss) first")
        sp = getattr(self.engine, "_protrain_sp", None)
        if sp is not None:
            sp.verify()             # sequence parallelism's checks, before anything is applied
        self.runtime.step()
        # The holder of the param groups is never stepped itself; tell torch's LR schedulers
        # that an optimizer step did happen (they warn otherwise).
        self.optimizer._opt_called = True
        opt = self.runtime.optimizer
        self.overflow = opt.overflow
        self._global_grad_norm = opt.global_grad_norm

    @property
    def parameter_offload(self) -> "NoZero3Hooks":
        """ZeRO-3's hook holder, for callers that read the JSON's stage 3 (TRL's
        ``unwrap_model_for_generation``): ProTrain has no ZeRO-3 hooks to take off."""
        return NoZero3Hooks()

    def zero_grad(self, set_to_none: bool = True):
        """Drop the gradients accumulated since the last step (DeepSpeed calls it after every
        step, when there are none; a script between micro-batches, as ZeRO-0's drops every
        ``p.grad``). After the boundary's backward it is refused: the step's update has begun."""
        if self.runtime is None:
            return
        if self.runtime.optimizer.boundary_backward_done:
            raise RuntimeError(
                "ProTrain: zero_grad() (the engine's or its optimizer's) between the accumulation "
                "boundary's backward and engine.step(): ProTrain applies the step's update from "
                "that backward on (CPU Adam runs under it), so its gradients cannot be dropped any "
                "more and this step cannot be skipped exactly. To skip a batch (a NaN loss), test "
                "the loss before engine.backward(loss); resume from the last checkpoint now")
        self.runtime.optimizer.zero_grad()

    @property
    def cur_scale(self):
        return self.loss_scaler.cur_scale if self.loss_scaler is not None else 1.0

    def state_dict(self):
        raise NotImplementedError(
            "optimizer.state_dict() of a ProTrain engine: its Adam states live in chunks sharded "
            "over the ranks, on the host or on NVMe, and are saved with the rest of the training "
            "state by engine.save_checkpoint(DIR) on every rank (as ZeRO's are); "
            "engine.load_checkpoint(DIR) resumes them, and python -m protrain_ds.checkpoint DIR "
            "OUT.pt exports the weights")

    def load_state_dict(self, state_dict):
        raise NotImplementedError(
            "optimizer.load_state_dict() of a ProTrain engine: resume with "
            "engine.load_checkpoint(DIR) from a checkpoint written by engine.save_checkpoint(DIR)")


class NoZero3Hooks:
    """What a caller that reads ZeRO stage 3 in the JSON finds at
    ``engine.optimizer.parameter_offload``. TRL's ``unwrap_model_for_generation`` (GRPO, RLOO,
    its generation callbacks) takes ZeRO-3's module hooks off around ``generate`` and puts them
    back (``remove_hooks`` / ``add_hooks``); ProTrain installs no ZeRO-3 hooks, and the forward
    hooks it has (runtime/outside.py: a forward outside ``engine(...)`` gathers what it needs)
    must stay for that very ``generate``. So there is nothing to take off: no module whose
    parameters carry ZeRO-3 bookkeeping, no hooks, and putting back does nothing."""

    def __init__(self):
        self.module = _NoZero3Module()
        self.forward_hooks: list = []
        self.backward_hooks: list = []

    def _register_deepspeed_module(self, module) -> None:
        """ZeRO-3 registers its hooks again here; nothing was removed."""


class _NoZero3Module(torch.nn.Module):
    """An empty module with ZeRO-3's one extra method (external parameters: none)."""

    def ds_external_parameters(self) -> list:
        return []
