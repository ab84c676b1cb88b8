"""Engines ProTrain does not run: plain DeepSpeed runs them, and the start-up says so.

ProTrain plans one thing - a data-parallel training step updated by Adam from chunks - so for
an engine outside that, the section asks for nothing ProTrain can give, and refusing would
make a JSON shared by several engines of one script (a DPO policy and its reference model, a
fine-tune and its evaluator) unusable. Instead ProTrain steps aside and DeepSpeed's own engine
runs it, exactly as without the section, printed at start-up with the reason and what memory
settings apply:

- no optimizer (a reference model, an evaluation before training): forward passes only. Run at
  ZeRO stage 0 so the parameters stay plain tensors a later ProTrain engine on the same model
  can take; a model built under ``zero.Init`` keeps the JSON's ZeRO-3 (ZeRO-3 inference).
- a ``PipelineModule``: pipeline parallelism is DeepSpeed's pipeline engine, which ProTrain's
  planner does not model. The JSON runs as written.
- an optimizer the chunk runtime cannot run (a JSON ``optimizer.type`` other than Adam/AdamW,
  ``amsgrad``; a client optimizer that is not Adam/AdamW, or one with ``amsgrad``, ``maximize``,
  ``capturable`` or ``differentiable``): DeepSpeed runs that optimizer, the JSON as written.

The reasons are rank-independent (the same model class, config and optimizer on every rank),
so all ranks step aside together.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .handover import retire_engines_of


@dataclass
class StepAside:
    """Why ProTrain does not run an engine, and the config plain DeepSpeed gets instead."""
    reason: str
    """What ProTrain does not run, as the start-up line says it."""
    config: dict
    """The DeepSpeed config for DeepSpeed's own engine (never with the "protrain" section)."""
    memory: str
    """Which memory settings apply now, for the start-up line."""


AS_WRITTEN = ("with the JSON as written (its zero_optimization and offload settings; ProTrain "
              "plans nothing for this engine)")


def without_section(ds_config: dict) -> dict:
    return {k: v for k, v in ds_config.items() if k != "protrain"}


def json_optimizer_outside(ds_config: dict) -> str | None:
    """Why the JSON's ``optimizer`` section is one the chunk runtime cannot run (None: it can,
    or there is none)."""
    opt = ds_config.get("optimizer")
    if opt is None:
        return None
    kind = str(opt.get("type", ""))
    if kind.lower() not in ("adam", "adamw"):
        return (f"the JSON's optimizer.type={kind!r} (the chunk runtime updates with Adam/AdamW "
                f"kernels only)")
    if (opt.get("params") or {}).get("amsgrad"):
        return "the JSON's optimizer.params.amsgrad=true (the chunk runtime runs Adam without it)"
    return None


_TORCH_ADAM_UNSUPPORTED = {"amsgrad": True, "maximize": True, "capturable": True, "differentiable": True}


def client_optimizer_outside(opt) -> str | None:
    """Why a client optimizer (an instance) is one the chunk runtime cannot run (None: it can:
    torch's Adam/AdamW, DeepSpeed's CPU Adam or FusedAdam)."""
    name = type(opt).__name__
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        for g in opt.param_groups or [opt.defaults]:
            for key, bad in _TORCH_ADAM_UNSUPPORTED.items():
                if g.get(key) == bad:
                    return (f"the client optimizer {name}({key}={bad}) (the chunk runtime runs "
                            f"Adam without {key})")
        return None
    if any(hasattr(opt, attr) for attr in ("adam_w_mode", "adamw_mode")):
        return None        # DeepSpeedCPUAdam, FusedAdam
    return (f"the client optimizer {name} (the chunk runtime updates with Adam/AdamW kernels "
            f"only: torch.optim.Adam/AdamW, DeepSpeedCPUAdam or FusedAdam)")


def instantiate_client_optimizer(kw: dict, model) -> None:
    """A callable client optimizer is called here, as DeepSpeed would call it (on the
    parameters given, else the model's), so its type is known before choosing the engine; both
    engines then take the instance."""
    opt = kw["optimizer"]
    if opt is None or isinstance(opt, torch.optim.Optimizer) or not callable(opt):
        return
    params = kw["model_parameters"]
    params = list(model.parameters()) if params is None else list(params)
    kw["model_parameters"] = params
    kw["optimizer"] = opt(params)


def decide(model, ds_config: dict, clean: dict, kw: dict, built_under_zero_init: bool) -> StepAside | None:
    """Whether ProTrain steps aside for this engine, and how DeepSpeed runs it instead.
    ``clean``: the config with the knobs ProTrain replaces taken out (stage 0)."""
    from deepspeed.runtime.pipe.module import PipelineModule
    if isinstance(model, PipelineModule):
        return StepAside("a PipelineModule (DeepSpeed's pipeline engine: ProTrain plans "
                         "data-parallel training)", without_section(ds_config), AS_WRITTEN)
    if kw["optimizer"] is None and "optimizer" not in ds_config:
        if built_under_zero_init:
            return StepAside(_NO_OPTIMIZER, without_section(ds_config),
                             "with the JSON's ZeRO-3 (the model was built partitioned, under zero.Init)")
        return StepAside(_NO_OPTIMIZER, without_section(clean),
                         "with ZeRO stage 0 (the whole model on the device). For a model larger than "
                         "the device, run its inference without the \"protrain\" section (ZeRO-3 "
                         "inference)")
    reason = (client_optimizer_outside(kw["optimizer"]) if kw["optimizer"] is not None
              else json_optimizer_outside(ds_config))
    if reason is not None:
        return StepAside(reason, without_section(ds_config),
                         AS_WRITTEN + ". To have ProTrain manage its memory, use Adam or AdamW "
                         "without those settings")
    return None


_NO_OPTIMIZER = ("an engine without an optimizer (no \"optimizer\" section, none passed to "
                 "initialize), which only runs forward passes")


def run(aside: StepAside, kw: dict, model, deepspeed_initialize, verbosity: int):
    """DeepSpeed's own initialize on ``aside.config``, after retiring a ProTrain engine that ran
    this model; the start-up line on rank 0."""
    from deepspeed import comm as dist
    retire_engines_of(model, "a newer DeepSpeed engine")
    args = kw["args"]
    if args is not None and (getattr(args, "deepspeed_config", None) is not None
                             or getattr(args, "deepscale_config", None) is not None):
        # DeepSpeed refuses a config both in args and in the call: the call's, on a copy.
        args = copy.copy(args)
        for name in ("deepspeed_config", "deepscale_config"):
            if hasattr(args, name):
                setattr(args, name, None)
    out = deepspeed_initialize(**dict(kw, args=args, config=aside.config, config_params=None))
    if (not dist.is_initialized() or dist.get_rank() == 0) and verbosity >= 1:
        print(f"ProTrain: {aside.reason}: ProTrain steps aside and plain DeepSpeed runs this "
              f"engine {aside.memory}", flush=True)
    return out
