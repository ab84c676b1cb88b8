"""Contract with DeepSpeed's private API: fails loudly when what the engine relies on moves.

ProTrainEngine overrides or calls these (protrain_ds/engine.py, optimizer.py, initialize.py).
If DeepSpeed changes one, update the adapter and the pinned version together."""
import inspect

import deepspeed
import pytest
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.engine import DeepSpeedEngine


def params(fn):
    return list(inspect.signature(fn).parameters)


def test_pinned_version():
    assert deepspeed.__version__ == "0.19.8", "protrain_ds is written against DeepSpeed 0.19.8"


@pytest.mark.parametrize("name, expected", [
    ("__init__", ["self", "args", "model", "optimizer", "model_parameters", "training_data",
                  "lr_scheduler", "mpu", "dist_init_required", "collate_fn", "config",
                  "config_class", "mesh_device", "dont_change_device"]),
    ("_configure_optimizer", ["self", "client_optimizer", "model_parameters"]),
    ("clip_fp32_gradients", ["self"]),
    ("_broadcast_model", ["self"]),
    ("forward", ["args", "kwargs"]),              # wrapped by instrument_w_nvtx
    ("destroy", ["self"]),
    ("_configure_python_gc", ["self"]),
    ("is_gradient_accumulation_boundary", ["self"]),
    ("gradient_accumulation_steps", ["self"]),
    ("gradient_clipping", ["self"]),
    ("optimizer_name", ["self"]), ("optimizer_params", ["self"]),
    ("fp16_enabled", ["self"]), ("loss_scale", ["self"]), ("dynamic_loss_scale", ["self"]),
    ("dynamic_loss_scale_args", ["self"]),
    ("compile", ["self", "backend", "compile_kwargs", "schedule", "compiled_autograd_enabled"]),
])
def test_engine_methods(name, expected):
    assert params(getattr(DeepSpeedEngine, name)) == expected


def test_engine_calls_what_the_adapter_provides():
    # The engine must still build the optimizer through _configure_optimizer, clip through
    # clip_fp32_gradients, read overflow / _global_grad_norm and call zero_grad after step.
    src = inspect.getsource(DeepSpeedEngine)
    for needle in ("self._configure_optimizer(optimizer, model_parameters)",
                   "self.clip_fp32_gradients()", "self._broadcast_model()",
                   "self.optimizer.overflow", "self.optimizer._global_grad_norm",
                   "self.optimizer.scale_if_loss(loss)", "self.optimizer.backward_prologue()",
                   "self.optimizer.backward_epilogue()", "if not (self.dont_change_device"):
        assert needle in src, needle


def test_zero_optimizer_hooks():
    for name in ("backward_prologue", "backward_epilogue", "scale_if_loss", "needs_scaler",
                 "enter_backward", "exit_backward", "queue_post_backward_callback",
                 "register_grad_acc_post_hook", "is_gradient_accumulation_boundary"):
        assert callable(getattr(ZeROOptimizer, name)), name
    assert "custom_loss_scaler" in inspect.getsource(ZeROOptimizer.needs_scaler)


def test_initialize_building_blocks():
    from deepspeed.comm import init_distributed
    from deepspeed.runtime import zero
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
    assert {"dist_backend", "distributed_port", "dist_init_required"} <= set(params(init_distributed))
    assert callable(zero.partition_parameters.shutdown_init_context)
    assert callable(zero.partition_parameters.restore_init_context)
    assert params(DeepSpeedConfig.__init__)[:3] == ["self", "config", "mpu"]
    assert params(CreateLossScaler) == ["dtype", "static_loss_scale", "dynamic_scaling", "dynamic_loss_args"]
    assert params(load_ds_config) == ["config"]
    assert params(deepspeed.initialize)[:3] == ["args", "model", "optimizer"]


def test_cpu_adam_kernel_entry_point():
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    src = inspect.getsource(DeepSpeedCPUAdam)
    assert "self.ds_opt_adam.adam_update(self.opt_id, state['step'], group['lr'], beta1, beta2" in src


def test_engine_compile_state_the_adapter_sets():
    # ProTrainEngine.compile keeps DeepSpeed's record of a compiled engine (protrain_ds/compile.py).
    assert "return self._is_compiled" in inspect.getsource(DeepSpeedEngine.is_compiled.fget)
    init = inspect.getsource(DeepSpeedEngine.__init__)
    for needle in ("self._is_compiled = False", "self._compile_mode = None", "self._compile_kwargs = {}"):
        assert needle in init, needle
