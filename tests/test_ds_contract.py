"""Contract with DeepSpeed's private API: fails loudly when what the engine relies on moves.

ProTrainEngine overrides or calls these (protrain_ds/engine.py, optimizer.py, initialize.py).
If DeepSpeed changes one, update the adapter and the pinned version together."""
import inspect
import re

import deepspeed
import pytest
from deepspeed.runtime.engine import DeepSpeedEngine


def params(fn):
    return list(inspect.signature(fn).parameters)


def test_the_installed_deepspeed_is_one_the_engine_is_checked_against():
    from packaging.specifiers import SpecifierSet

    from protrain_ds import contract
    assert deepspeed.__version__ in SpecifierSet(contract.CHECKED), deepspeed.__version__
    assert contract.broken() == ()


def test_setup_py_names_the_same_range():
    import pathlib
    import re

    from protrain_ds import contract
    setup = (pathlib.Path(__file__).parent.parent / "setup.py").read_text()
    assert re.search(r'"deepspeed": \["deepspeed' + re.escape(contract.CHECKED) + '"', setup), contract.CHECKED


def test_a_deepspeed_whose_internals_moved_is_refused_by_name(monkeypatch):
    """initialize refuses, naming what moved and the versions checked, rather than running an
    engine whose overrides no longer meet DeepSpeed's code."""
    from protrain.config import ConfigError
    from protrain_ds import contract
    monkeypatch.setitem(contract.ENGINE_METHODS, "_configure_optimizer", ["self", "optimizer"])
    contract.broken.cache_clear()
    try:
        from dstrain import base_config, train, with_protrain
        with pytest.raises(ConfigError, match=r"internals that changed.*_configure_optimizer.*"
                                              + re.escape(contract.CHECKED)):
            train(with_protrain(base_config()), steps=1)
    finally:
        monkeypatch.undo()
        contract.broken.cache_clear()
    assert contract.broken() == ()


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
