"""What ProTrain's engine relies on inside DeepSpeed, checked when a ProTrain engine is built.

``ProTrainEngine`` subclasses ``DeepSpeedEngine`` and overrides or calls some of its private
methods (engine.py, optimizer.py, initialize.py). A DeepSpeed release that moves one of them
would make the engine fail in odd places or, worse, train silently wrong. So the points it
relies on are listed here and checked once per process at ``initialize`` (a few milliseconds):
a DeepSpeed whose internals moved is refused by name, whatever its version number says, and
one whose internals match runs. tests/test_ds_contract.py runs the same check on the installed
DeepSpeed; docs/compatibility.md lists the versions the suite ran on.
"""
from __future__ import annotations

import functools
import inspect

CHECKED = ">=0.19.8,<0.20"
"""The DeepSpeed versions the suite ran on (setup.py's ``deepspeed`` extra)."""

ENGINE_METHODS = {
    "__init__": ["self", "args", "model", "optimizer", "model_parameters", "training_data",
                 "lr_scheduler", "mpu", "dist_init_required", "collate_fn", "config",
                 "config_class", "mesh_device", "dont_change_device"],
    "_configure_optimizer": ["self", "client_optimizer", "model_parameters"],
    "clip_fp32_gradients": ["self"],
    "_broadcast_model": ["self"],
    "forward": ["args", "kwargs"],              # wrapped by instrument_w_nvtx
    "destroy": ["self"],
    "_configure_python_gc": ["self"],
    "is_gradient_accumulation_boundary": ["self"],
    "set_gradient_accumulation_boundary": ["self", "is_boundary"],
    "gradient_accumulation_steps": ["self"],
    "gradient_clipping": ["self"],
    "optimizer_name": ["self"], "optimizer_params": ["self"],
    "fp16_enabled": ["self"], "loss_scale": ["self"], "dynamic_loss_scale": ["self"],
    "dynamic_loss_scale_args": ["self"],
    "no_sync": ["self"],
    "compile": ["self", "backend", "compile_kwargs", "schedule", "compiled_autograd_enabled"],
}
"""Methods overridden or called, with their parameters."""

ENGINE_SOURCE = (
    # builds the optimizer through _configure_optimizer, clips through clip_fp32_gradients,
    # reads overflow / _global_grad_norm and calls the optimizer's backward hooks
    "self._configure_optimizer(optimizer, model_parameters)", "self.clip_fp32_gradients()",
    "self._broadcast_model()", "self.optimizer.overflow", "self.optimizer._global_grad_norm",
    "self.optimizer.scale_if_loss(loss)", "self.optimizer.backward_prologue()",
    "self.optimizer.backward_epilogue()", "if not (self.dont_change_device",
    # accumulation by hand (accumulation.py): the flags no_sync() and the boundary setter keep
    "self.inside_no_sync_ctxt = True", "self._is_gradient_accumulation_boundary = is_boundary",
    # a compiled engine's record (compile.py)
    "self._is_compiled = False", "self._compile_mode = None", "self._compile_kwargs = {}",
)
"""Lines the engine's source must still hold."""

OPTIMIZER_HOOKS = ("backward_prologue", "backward_epilogue", "scale_if_loss", "needs_scaler",
                   "enter_backward", "exit_backward", "queue_post_backward_callback",
                   "register_grad_acc_post_hook", "is_gradient_accumulation_boundary")
"""ZeROOptimizer methods ProTrainOptimizer inherits and the engine calls."""


@functools.cache
def broken() -> tuple[str, ...]:
    """What of the above the installed DeepSpeed no longer has (empty: all of it)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    out = []
    for name, expected in ENGINE_METHODS.items():
        fn = getattr(DeepSpeedEngine, name, None)
        if fn is None:
            out.append(f"DeepSpeedEngine.{name} is gone")
            continue
        got = list(inspect.signature(fn).parameters)
        if got != expected:
            out.append(f"DeepSpeedEngine.{name}{tuple(got)} (expected {tuple(expected)})")
    try:
        src = inspect.getsource(DeepSpeedEngine)
    except (OSError, TypeError):           # no source shipped: the signatures must do
        src = None
    if src is not None:
        out += [f"DeepSpeedEngine no longer has `{line}`" for line in ENGINE_SOURCE if line not in src]
    out += [f"ZeROOptimizer.{name} is gone" for name in OPTIMIZER_HOOKS
            if not callable(getattr(ZeROOptimizer, name, None))]
    return tuple(out)


def check() -> None:
    """Refuse, by name, a DeepSpeed whose internals moved (``broken``)."""
    problems = broken()
    if problems:
        import deepspeed

        from protrain.config import ConfigError
        raise ConfigError(
            f"ProTrain's DeepSpeed engine overrides DeepSpeed internals that changed in DeepSpeed "
            f"{deepspeed.__version__}: {'; '.join(problems[:4])}"
            f"{f' (and {len(problems) - 4} more)' if len(problems) > 4 else ''}. It is checked "
            f"against DeepSpeed {CHECKED}: pip install 'protrain[deepspeed]' installs one, or "
            f"remove the \"protrain\" section to run plain DeepSpeed")
