"""Run real plans on the block-shape models (protrain/block_shapes.py) through the
framework-neutral runtime and measure them with both meters: the runtime's own count of
device-resident bytes (the storage counter the profile was taken with) and the allocator's
bytes in use (``HeapPeak``: glibc mallinfo2 on CPU)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from protrain.block_mode import BlockMode
from protrain.block_shapes import ShapeConfig, ShapeNet, shape_batch
from protrain.config import PlannerConfig
from protrain.plan import Knobs, Plan
from protrain.profile.hardware import HardwareProfile
from protrain.measure.heap_peak import HeapPeak
from protrain.profile.model_profile import ModelProfile
from protrain.measure.profiler import profile_model
from protrain.runtime.adam import AdamHyper
from protrain.runtime.options import OptimizerSetup, RuntimeOptions
from protrain.runtime.runtime import ProTrainRuntime
from protrain.search import evaluate, search

GiB = 2**30
HW = HardwareProfile(name="cpu-test", source="measured", device_type="cpu", device_memory=GiB,
                     host_memory=GiB, h2d_bandwidth=1e9, d2h_bandwidth=1e9, gpu_adam_rate=1e9,
                     cpu_adam_rate=1e9, nvme_write_bandwidth=1e9, nvme_read_bandwidth=1e9,
                     nvme_free_bytes=GiB)
MICRO_BATCH, SEQ = 2, 32


@dataclass
class Shape:
    cfg: ShapeConfig
    model: ShapeNet
    batch: tuple
    profile: ModelProfile


def shape(kind: str, **over) -> Shape:
    cfg = ShapeConfig(kind=kind, **over)
    torch.manual_seed(0)
    model = ShapeNet(cfg)
    x, y = shape_batch(cfg, MICRO_BATCH, SEQ)
    prof = profile_model(model, lambda m: m(x, y), progress=False, name=kind,
                         micro_batch=MICRO_BATCH, seq_len=SEQ)
    return Shape(cfg, model, (x, y), prof)


def plan_for(s: Shape, modes: str | None = None, hw: HardwareProfile = HW, **config) -> Plan:
    """The plan with block modes ``modes`` (e.g. "SCNC") and every chunk persistent; or, without ``modes``, what the search picks under ``config``."""
    if modes is None:
        return search(s.profile, hw, PlannerConfig(**config))
    knobs = Knobs(chunk_size=s.profile.total_params * s.profile.param_bytes, n_persist=1, n_buffer=0,
                  n_swap=modes.count("S"), n_checkpoint=modes.count("C"), n_ssd=modes.count("D"))
    letters = {m.letter: m for m in BlockMode}
    plan = evaluate(s.profile, hw, knobs, PlannerConfig(**config),
                    block_modes=tuple(letters[c] for c in modes))
    assert "".join(m.letter for m in plan.block_modes) == modes, plan.block_modes
    return plan


@dataclass
class Measured:
    activation_peak: int
    """Storage counter: live activation bytes (the runtime's accounting)."""
    device_peak: int
    """Storage counter: activations plus the chunk states the runtime holds on the device."""
    heap_peak: int
    """Allocator: bytes in use above the level before the forward pass (forward + backward)."""
    stats: dict


def run(s: Shape, plan: Plan, *, ssd_root=None, iterations: int = 2) -> Measured:
    """Train ``iterations`` steps with ``plan``; measure the last one."""
    model = s.model
    shell = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def hyper(g):
        return AdamHyper(lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                         weight_decay=g["weight_decay"], bias_correction=True, adamw=True)
    rt = ProTrainRuntime(model, model.blocks, plan, torch.device("cpu"),
                         OptimizerSetup(param_groups=shell.param_groups, hyper=hyper, adamw=True,
                                        torch_adam=True),
                         RuntimeOptions(accounting=True, ssd_root=ssd_root, ssd_min_bytes=0))
    x, y = s.batch
    try:
        for i in range(iterations):
            heap = HeapPeak("cpu") if i == iterations - 1 else None
            if heap is not None:
                heap.__enter__()
            with rt.forward_context():
                loss = model(x, y)
            rt.begin_backward()
            loss.backward()
            del loss
            rt.finish_backward()
            if heap is not None:
                heap.stop()
            rt.step()
            if heap is not None:
                heap.__exit__(None, None, None)
        return Measured(rt.accounting.activation_peak, rt.device_peak(), heap.peak,
                        dict(rt.activations.stats))
    finally:
        rt.close()
