"""The runtime's CPU work per offloaded parameter beyond the Adam kernel (cost/host_update.py):
which passes each setup makes, and the rate the cost model prices CPU Adam at."""
from dataclasses import replace

import pytest
import torch

from protrain.cost.host_update import HostUpdatePasses, host_update_passes, runtime_update_rate
from protrain.profile.machines import machine
from protrain.units import GiB


@pytest.mark.parametrize("fused, half, ga, scaled, in_place, copies", [
    (False, False, False, True, 2, 0),    # fp32, clipping, DeepSpeed's kernel: scale, zero
    (False, False, False, False, 1, 0),   # fp32, no clipping: zero
    (False, True, False, True, 1, 2),     # bf16, DeepSpeed's kernel: scale; widen, upload copy
    (True, True, False, True, 0, 1),      # bf16, native kernel (widens, scales): upload copy
    (True, True, True, True, 1, 1),       # ... with accumulation: the fp32 region zeroed too
    (True, False, True, False, 1, 0),
])
def test_the_passes_around_the_kernel(fused, half, ga, scaled, in_place, copies):
    assert host_update_passes(fused_kernel=fused, half=half, grad_accumulation=ga, scaled=scaled) == \
        HostUpdatePasses(in_place=in_place, copies=copies)


def test_the_rate_adds_each_pass_at_its_measured_speed():
    hw = replace(machine("h100-80gb").profile(host_memory=64 * GiB), cpu_adam_rate=1e9,
                 host_pass_rate=4e9, host_copy_bandwidth=8e9)
    got = runtime_update_rate(hw, HostUpdatePasses(in_place=2, copies=1))
    # per parameter: 1 ns kernel + 2 x 0.25 ns in place + 4 bytes / 8 GB/s = 2 ns
    assert got.cpu_adam_rate == pytest.approx(0.5e9, rel=1e-12)
    assert got.cpu_adam_kernel_rate == 1e9
    assert "kernel 1.00" in got.describe()
    with pytest.raises(ValueError, match="already"):
        runtime_update_rate(got, HostUpdatePasses(1, 0))
    # no passes, or pass speeds not measured (published machines): the kernel's rate
    assert runtime_update_rate(hw, HostUpdatePasses(0, 0)) == hw
    unmeasured = replace(hw, host_pass_rate=0.0)
    assert runtime_update_rate(unmeasured, HostUpdatePasses(2, 1)) == unmeasured


def test_the_runtime_makes_the_passes_the_table_says(monkeypatch):
    """fp32 with clipping on DeepSpeed's kernel (the CPU engine's case): each update of an
    offloaded chunk scales its gradients in place and zeroes them after - counted exactly on
    the real runtime, by the tensor methods it calls, over two steps."""
    import json

    from dstrain import base_config, train, with_protrain
    from test_ds_engine import SHAPES
    calls = {"mul_": 0, "zero_": 0}
    for name in calls:
        real = getattr(torch.Tensor, name)

        def counting(self, *a, _real=real, _name=name, **k):
            if self.dim() == 1 and self.numel() > 1000 and self.dtype == torch.float32:
                calls[_name] += 1
            return _real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counting)
    model_cfg, pins = SHAPES["a mix"]
    _, _, engine = train(with_protrain(base_config(**json.loads('{"gradient_clipping": 1.0}')), **pins),
                         model_cfg, 2)
    plan = engine.protrain_plan
    n_off = plan.chunks.n_chunks - plan.knobs.n_persist
    engine.destroy()
    assert n_off > 0
    assert "with the runtime's passes" in plan.machine
    passes = host_update_passes(fused_kernel=False, half=False, grad_accumulation=False, scaled=True)
    assert passes == HostUpdatePasses(in_place=2, copies=0)
    # per step, every chunk's gradients scaled once and zeroed once (persistent ones alike);
    # the offloaded chunks' fp32 gradient regions zeroed once more when they are made
    steps, n = 2, plan.chunks.n_chunks
    assert calls == {"mul_": steps * n, "zero_": n_off + steps * n}, (calls, n_off, n)
