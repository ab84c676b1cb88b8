"""initialize: DeepSpeed's ``deepspeed.initialize`` with ProTrain behind it when the config
says ``"protrain": {"enabled": true}``, and untouched DeepSpeed otherwise.

Installed over ``deepspeed.initialize`` by the start-up hook (protrain/_autoload.py), so both
``deepspeed.initialize(...)`` and ``from deepspeed import initialize`` get it; also callable
directly as ``protrain_ds.initialize``.
"""
from __future__ import annotations

import functools

from protrain.config import ConfigError

from .config import ProTrainDSConfig, is_enabled, load_ds_config, refuse_conflicts, strip_replaced_knobs
from . import step_aside, zero_init
from .handover import retire_engines_of

_ORIGINAL = "_protrain_original_initialize"


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """Same signature and return value as ``deepspeed.initialize``: (engine, optimizer,
    training_dataloader, lr_scheduler)."""
    original = _deepspeed_initialize()
    kwargs = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                  training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                  dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                  mesh_param=mesh_param, config_params=config_params)
    if distributed_port is not None:
        kwargs["distributed_port"] = distributed_port
    ds_config = _resolve_config(args, config, config_params)
    if ds_config is None or not is_enabled(ds_config):
        if ds_config is not None:
            ProTrainDSConfig.from_ds_config(ds_config)  # a typo in a disabled section still fails
        # A ProTrain engine running this model hands it over first (handover.py).
        retire_engines_of(_module_of(model), "a newer DeepSpeed engine")
        return original(**kwargs)
    return _initialize_protrain(ds_config, kwargs)


def _deepspeed_initialize():
    """DeepSpeed's own initialize (not the wrapper installed over it)."""
    import deepspeed
    original = getattr(deepspeed, _ORIGINAL, None) or deepspeed.initialize
    if getattr(original, "_protrain_wrapper", False):
        original = original.__wrapped__
    return original


def _module_of(model):
    """The nn.Module behind ``model`` (a torch.compile wrapper's original), or None."""
    import torch
    model = getattr(model, "_orig_mod", model)
    return model if isinstance(model, torch.nn.Module) else None


def _resolve_config(args, config, config_params):
    config = config if config is not None else config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        return None
    return load_ds_config(config)


def _initialize_protrain(ds_config: dict, kw: dict):
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime import zero
    from deepspeed.runtime.config import DeepSpeedConfig

    from . import contract
    from .compile import eager_model
    from .engine import ProTrainEngine

    contract.check()           # a DeepSpeed whose internals moved is refused by name
    pt_config = ProTrainDSConfig.from_ds_config(ds_config)
    refuse_conflicts(ds_config)
    # torch.compile(model): the engine plans on the eager model and compiles its blocks.
    model, compile_request = eager_model(kw["model"])
    if model is None:
        # DeepSpeed's own check, and its exception (AssertionError), as without the section.
        return _deepspeed_initialize()(**dict(kw, config=step_aside.without_section(ds_config), config_params=None))
    clean, overridden = strip_replaced_knobs(ds_config)
    built_under_zero_init = bool(zero_init.partitioned(model))
    step_aside.instantiate_client_optimizer(kw, model)
    aside = step_aside.decide(model, ds_config, clean, kw, built_under_zero_init)
    if aside is not None:
        return step_aside.run(aside, kw, model, _deepspeed_initialize(), pt_config.verbosity)
    retire_engines_of(model, "a newer ProTrain engine")
    zero.partition_parameters.shutdown_init_context()
    if built_under_zero_init:
        n = zero_init.unpartition(model)
        if (not dist.is_initialized() or dist.get_rank() == 0) and pt_config.verbosity >= 1:
            print(f"ProTrain: the model was built under ZeRO-3's zero.Init (transformers does so "
                  f"with a ZeRO-3 JSON): gathered its {n} partitioned parameters whole on the host; "
                  f"ProTrain places them in its chunks", flush=True)
    dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                          distributed_port=kw.get("distributed_port", 29500),
                          dist_init_required=kw["dist_init_required"])
    args = kw["args"]
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        # DeepSpeed refuses a config both in args and in the call: hand it over explicitly.
        args.deepspeed_config = None
    config_class = DeepSpeedConfig(clean, kw["mpu"])
    engine = ProTrainEngine(args=args, model=model, optimizer=kw["optimizer"],
                            model_parameters=kw["model_parameters"],
                            training_data=kw["training_data"], lr_scheduler=kw["lr_scheduler"],
                            mpu=kw["mpu"], dist_init_required=kw["dist_init_required"],
                            collate_fn=kw["collate_fn"], config=clean, config_class=config_class,
                            protrain_config=pt_config, overridden=overridden,
                            compile_request=compile_request,
                            zero_stage=int((ds_config.get("zero_optimization") or {}).get("stage") or 0))
    zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def install(deepspeed_module) -> None:
    """Put the wrapper in place of ``deepspeed.initialize`` (idempotent)."""
    current = deepspeed_module.initialize
    if getattr(current, "_protrain_wrapper", False):
        return
    setattr(deepspeed_module, _ORIGINAL, current)

    @functools.wraps(current)
    def wrapper(*args, **kwargs):
        return initialize(*args, **kwargs)

    wrapper._protrain_wrapper = True
    deepspeed_module.initialize = wrapper
