"""The framework-neutral runtime, driven directly (as the Megatron adapter will drive it)."""
import copy
from dataclasses import replace

import pytest
import torch

from protrain.config import KnobPins, PlannerConfig
from protrain.models import GPT, GPTConfig, synthetic_batch
from protrain.profile.hardware import HardwareProfile
from protrain.measure.profiler import profile_model
from protrain.runtime.adam import AdamHyper
from protrain.runtime.chunks import ChunkState
from protrain.runtime.options import OptimizerSetup
from protrain.runtime.runtime import ProTrainRuntime
from protrain.search import search
from protrain.units import GiB

CFG = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=64, tie_embeddings=False)
HW = HardwareProfile(name="test", source="measured", device_type="cpu", device_memory=GiB,
                     host_memory=GiB, h2d_bandwidth=1e10, d2h_bandwidth=1e10, gpu_adam_rate=1e9,
                     cpu_adam_rate=1e9)
PINS = KnobPins(chunk_size=110 * 1024, n_persist=2, n_buffer=4, n_swap=1, n_checkpoint=2)


def build(model, *, lr=1e-3, clip=0.0, loss_scaler=None, torch_adam=True, pins=PINS,
          speculate_chunks=None):
    x, y = synthetic_batch(CFG, 2, seed=100)
    prof = profile_model(model, lambda m: m(x, y), progress=False)
    plan = search(prof, HW, PlannerConfig(pins=pins))
    shell = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def hyper(g):
        return AdamHyper(lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                         weight_decay=g["weight_decay"], bias_correction=True, adamw=True)
    setup = OptimizerSetup(param_groups=shell.param_groups, hyper=hyper, adamw=True,
                           torch_adam=torch_adam, clip=clip, loss_scaler=loss_scaler,
                           speculate_chunks=speculate_chunks)
    return ProTrainRuntime(model, model.transformer.h, plan, torch.device("cpu"), setup)


def step(rt, model, x, y, scale=1.0):
    with rt.forward_context():
        loss = model(x, y)
    rt.begin_backward()
    (loss * scale).backward()
    rt.finish_backward()
    rt.step()
    return loss.item()


def test_runtime_training_equals_plain_torch_adamw_bit_for_bit():
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    rt = build(model)
    assert rt.chunks.offloaded() and any(m.value == "swap" for m in rt.plan.block_modes)
    for i in range(10):
        x, y = synthetic_batch(CFG, 2, seed=i)
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert step(rt, model, x, y) == loss.item(), i
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b.data), n
    rt.close()
    # after close, parameters are plain tensors with the trained values
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b) and b.data.untyped_storage().nbytes() == b.numel() * 4, n


def test_evaluation_forward_between_steps():
    torch.manual_seed(0)
    model = GPT(CFG)
    rt = build(model)
    x, y = synthetic_batch(CFG, 2, seed=1)
    step(rt, model, x, y)
    with torch.no_grad(), rt.forward_context():
        logits = model(x)
    plain = GPT(CFG)
    plain.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    with torch.no_grad():
        assert torch.equal(plain(x), logits)
    step(rt, model, x, y)   # training goes on after an evaluation pass
    rt.close()


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    import dstrain  # noqa: F401  (the distributed environment DeepSpeed's loss scaler expects)
    import deepspeed
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = GPT(CFG).half()
    scaler = CreateLossScaler(dtype=torch.float16, static_loss_scale=0, dynamic_scaling=True,
                              dynamic_loss_args={"init_scale": 2**8, "scale_window": 1000,
                                                 "min_scale": 1, "delayed_shift": 1,
                                                 "consecutive_hysteresis": False})
    rt = build(model, loss_scaler=scaler, torch_adam=False,
               pins=KnobPins(chunk_size=55 * 1024, n_persist=2, n_buffer=4, n_swap=1, n_checkpoint=2))
    x, y = synthetic_batch(CFG, 2, seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step(rt, model, x, y, scale=float("inf"))             # every gradient overflows
    assert rt.optimizer.overflow and scaler.cur_scale == 2**7
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n     # nothing applied, host copies restored
    step(rt, model, x, y, scale=scaler.cur_scale)
    assert not rt.optimizer.overflow
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    rt.close()


def test_chunk_states_only_move_along_legal_transitions():
    torch.manual_seed(0)
    model = GPT(CFG)
    rt = build(model)
    c = rt.chunks.offloaded()[0]
    assert c.state == ChunkState.HOST
    with pytest.raises(RuntimeError, match="illegal move host -> grads"):
        c.move(ChunkState.GRADS)
    rt.close()


def test_no_cpu_adam_is_built_when_nothing_runs_on_the_host(monkeypatch):
    """The CPU Adam kernels need a compiler the first time: with every chunk on a GPU none is
    needed and none is built. With offloaded chunks a GPU machine builds ProTrain's native one
    (GIL-free) unless "deepspeed" is asked for; a CPU "device" updates with DeepSpeed's (inline
    updates: the GIL does not matter, and the bits are DeepSpeed's either way)."""
    import protrain.runtime.runtime as rt_mod
    from protrain.runtime.adam import TorchAdamKernel
    from protrain.runtime.options import OptimizerSetup
    from protrain.runtime.runtime import adam_kernels

    def no_compiler(which):
        def build(*a, **k):
            raise RuntimeError(f"no compiler for {which}")
        return build
    monkeypatch.setattr(rt_mod, "CPUAdamKernel", no_compiler("deepspeed"))
    monkeypatch.setattr(rt_mod, "NativeCPUAdamKernel", no_compiler("native"))
    setup = OptimizerSetup(param_groups=[], hyper=None, adamw=True)
    host, device = adam_kernels(torch.device("cuda"), setup, offloaded=False)
    assert host is None and isinstance(device, TorchAdamKernel) and device.fused
    with pytest.raises(RuntimeError, match="no compiler for native"):
        adam_kernels(torch.device("cuda"), setup, offloaded=True)
    with pytest.raises(RuntimeError, match="no compiler for deepspeed"):
        adam_kernels(torch.device("cuda"), replace(setup, cpu_adam="deepspeed"), offloaded=True)
    with pytest.raises(RuntimeError, match="no compiler for deepspeed"):
        adam_kernels(torch.device("cpu"), setup, offloaded=False)
    with pytest.raises(RuntimeError, match="no compiler for native"):
        adam_kernels(torch.device("cpu"), replace(setup, cpu_adam="native"), offloaded=False)
