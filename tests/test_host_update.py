"""The runtime's CPU work per offloaded parameter beyond the Adam kernel (cost/host_update.py):
which passes each setup makes, and the rate the cost model prices CPU Adam at."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from protrain.cost.host_update import HostUpdatePasses, host_update_passes, runtime_update_rate
from protrain.profile.machines import machine
from protrain.units import GiB


@pytest.mark.parametrize("fused, half, ga, scaled, in_place, copies", [
    (False, False, False, True, 1, 0),    # fp32, clipping, DeepSpeed's kernel: scale
    (False, False, False, False, 0, 0),   # fp32, no clipping: nothing (the next copy overwrites)
    (False, False, True, True, 2, 0),     # ... with accumulation: scale, zero the accumulator
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


def test_a_backup_is_priced_at_the_rate_of_the_way_the_runtime_takes_it():
    """A speculating chunk's backup (12 bytes per parameter of the rank's shard): at the rate
    measured for the native kernel's own pass where it takes it, else at a host copy's, else
    as long as the update."""
    from protrain.cost.chunk_times import backup_times
    from protrain.layout import build_layout
    from protrain.profile.analytic import PRESETS, analytic_profile
    hw = replace(machine("h100-80gb").profile(host_memory=64 * GiB), host_copy_bandwidth=8e9)
    layout = build_layout(analytic_profile(PRESETS["llama2-7b"], hw), 2**27)
    used, t_adam = np.asarray(layout.used, dtype=np.float64), np.full(layout.n_chunks, 0.5)
    assert np.allclose(backup_times(layout, hw, t_adam), used * 12 / 8e9, rtol=1e-12, atol=0)
    fused = replace(hw, backup_bandwidth=20e9)
    assert np.allclose(backup_times(layout, fused, t_adam, world=2), used * 12 / 2 / 20e9, rtol=1e-12, atol=0)
    assert np.array_equal(backup_times(layout, replace(hw, host_copy_bandwidth=0.0), t_adam), t_adam)


def test_the_engine_prices_the_backup_as_its_kernel_takes_it():
    """``backup_as_run``: DeepSpeed's kernel copies before the update (the fused figure
    cleared); the native kernel takes the backup in its pass, measured where the probe did not
    (a CPU "device", whose default kernel is DeepSpeed's) and only where a step may speculate."""
    from protrain.cost.host_update import backup_as_run
    from protrain.measure.probe import probe_hardware
    hw = replace(machine("h100-80gb").profile(host_memory=64 * GiB), backup_bandwidth=20e9)
    assert backup_as_run(hw, native=False, speculates=True).backup_bandwidth == 0.0
    assert backup_as_run(hw, native=True, speculates=True) == hw
    cpu = probe_hardware(torch.device("cpu"), progress=False)
    assert cpu.backup_bandwidth == 0.0
    assert backup_as_run(cpu, native=True, speculates=False) == cpu
    measured = backup_as_run(cpu, native=True, speculates=True, params=2**23)
    assert measured.backup_bandwidth > 0 and "backup in the update" in measured.describe()
    assert replace(measured, backup_bandwidth=0.0) == cpu


def test_the_runtime_makes_the_passes_the_table_says(monkeypatch):
    """fp32 with clipping on DeepSpeed's kernel (the CPU engine's case): each update of an
    offloaded chunk scales its gradients in place and leaves them (the next backward's copy
    overwrites them) - counted exactly on the real runtime, by the tensor methods it calls,
    over two steps."""
    import json

    from dstrain import base_config, train, with_protrain
    from test_ds_engine import SHAPES

    from protrain.measure.probe import probe_hardware
    probe_hardware(torch.device("cpu"), progress=False)   # cached: the probe's own passes not counted
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
    assert "backup in the update" not in plan.machine    # DeepSpeed's kernel: backups are copies
    passes = host_update_passes(fused_kernel=False, half=False, grad_accumulation=False, scaled=True)
    assert passes == HostUpdatePasses(in_place=1, copies=0)
    # per step, every chunk's gradients scaled once; the persistent chunks' gradients (added
    # into) zeroed once; the offloaded chunks' fp32 gradient regions zeroed once, when made
    steps, n = 2, plan.chunks.n_chunks
    assert calls == {"mul_": steps * n, "zero_": n_off + steps * (n - n_off)}, (calls, n_off, n)


def test_the_runtimes_time_per_chunk_update_is_priced_per_offloaded_chunk():
    """``host_update_overhead`` adds to each offloaded chunk's CPU Adam: on a CPU "device"
    (updates after backward, inline) the exposed time grows by exactly the offloaded chunks
    times it, and the search still agrees with a brute-force evaluation."""
    from protrain.config import KnobPins, PlannerConfig
    from protrain.layout import build_layout
    from protrain.cost.chunk_times import chunk_transfer_times
    from protrain.profile.analytic import ModelShape, analytic_profile
    from protrain.search import evaluate, search
    from protrain.units import MiB
    shape = ModelShape("o", "gpt2", n_layers=4, hidden=512, heads=8, vocab=4096, seq_len=256,
                       micro_batch=2)
    hw = replace(machine("h100-80gb").profile(host_memory=64 * GiB), copy_engines=0,
                 cpu_adam_rate=5e8)
    prof = analytic_profile(shape, hw)
    layout = build_layout(prof, 4 * MiB // prof.param_bytes)
    slow = replace(hw, host_update_overhead=2e-3)
    base_adam = chunk_transfer_times(layout, prof, hw)[2]
    adam = chunk_transfer_times(layout, prof, slow)[2]
    assert np.allclose(adam - base_adam, np.where(np.asarray(layout.used) > 0, 2e-3, 0.0), rtol=0, atol=1e-15)
    pins = KnobPins(chunk_size=4 * MiB, n_persist=1, n_buffer=4, n_swap=0, n_checkpoint=0, n_ssd=0,
                    n_selective=0)
    cfg = PlannerConfig(pins=pins, cpu_optim_overlap=False)
    before = evaluate(prof, hw, search(prof, hw, cfg).knobs, cfg)
    after = evaluate(prof, slow, before.knobs, cfg)
    n_off = before.chunks.n_chunks - before.knobs.n_persist
    assert n_off > 0
    assert after.prediction.cpu_optim_exposed - before.prediction.cpu_optim_exposed == \
        pytest.approx(n_off * 2e-3, rel=1e-9)
    assert "+ 2000 us per chunk update" in slow.describe()


def test_the_measured_time_per_chunk_excludes_the_kernel(monkeypatch):
    """measure/update_overhead.py steps the real ChunkOptimizer and leaves out what its kernel
    calls take: a kernel made 3 ms slower per call does not move it by 3 ms."""
    import time

    from protrain.measure.update_overhead import measure_update_overhead
    from protrain.runtime.adam import CPUAdamKernel
    plain = measure_update_overhead(reps=3)
    assert 0 < plain < 3e-3
    real = CPUAdamKernel.update

    def slow(self, *a, **k):
        time.sleep(3e-3)
        return real(self, *a, **k)
    monkeypatch.setattr(CPUAdamKernel, "update", slow)
    assert measure_update_overhead(reps=3) < 3e-3


def test_step_queuing_the_updates_after_the_verdict_is_exposed_with_a_worker_thread():
    """Issue 37 (exposed CPU Adam with clipping): with CPU Adam on a worker beside compute and
    its updates left for the verdict, step() decides and queues each offloaded chunk's update
    on the training thread before the next forward: ``step_dispatch_overhead`` per chunk is
    exposed and lengthens the iteration where the updates themselves are hidden (hand case:
    2 offloaded chunks, 0.5 s each), and costs nothing where updates ran during backward
    (no verdict to wait for) or inline (priced in each update's own time there)."""
    from conftest import chain_profile, slow_link
    from protrain.cost.time_model import simulate
    from protrain.layout import build_layout

    def run(dispatch, **kw):
        hw = slow_link(copy_engines=0, cpu_adam_rate=1000.0, step_dispatch_overhead=dispatch,
                       **({"cpu_adam_thread": True} | kw.pop("hw", {})))
        prof = chain_profile()
        t = simulate(prof, build_layout(prof, 100), hw, 1, 2, np.array([[0, 0]]), carry_over=True, **kw)
        return float(t.iter_time[0]), float(t.cpu_optim_exposed[0])
    it0, ex0 = run(0.0, cpu_overlap=False)
    it1, ex1 = run(0.5, cpu_overlap=False)
    assert ex0 == 0 and ex1 == pytest.approx(2 * 0.5) and it1 == pytest.approx(it0 + 2 * 0.5)
    assert run(0.5, cpu_overlap=True) == run(0.0, cpu_overlap=True)
    assert run(0.5, cpu_overlap=False, hw={"cpu_adam_thread": False}) == \
        run(0.0, cpu_overlap=False, hw={"cpu_adam_thread": False})
    assert "step() 500000 us per chunk" in slow_link(step_dispatch_overhead=0.5,
                                                      host_update_overhead=1e-3).describe()


def test_the_measured_step_dispatch_times_step_alone_with_the_updates_on_the_worker(monkeypatch):
    """measure_step_dispatch times step() with the worker threaded: the updates run on the
    worker thread (not in the timed call: a kernel 3 ms slower per call leaves it under 3 ms a
    chunk), and every queued update ran before the next timed step."""
    import threading
    import time

    from protrain.measure.update_overhead import measure_step_dispatch
    from protrain.runtime.adam import CPUAdamKernel
    real = CPUAdamKernel.update
    threads, calls = set(), []

    def slow(self, *a, **k):
        threads.add(threading.get_ident())
        calls.append(1)
        time.sleep(3e-3)
        return real(self, *a, **k)
    monkeypatch.setattr(CPUAdamKernel, "update", slow)
    t = measure_step_dispatch(reps=2)
    assert 0 < t < 3e-3
    assert threads and threading.get_ident() not in threads
    from protrain.measure.update_overhead import CHUNKS
    assert len(calls) == 3 * CHUNKS          # a warm-up and two timed steps, every chunk updated


def test_a_chunk_without_gradients_in_a_step_is_stepped_on_zeros():
    """fp32 without accumulation: the update leaves its gradient region as it is (the next
    copy overwrites it whole); a chunk that gets no gradient in the next step is zeroed at
    that step and stepped on zeros (DeepSpeed ZeRO-0 fills a missing gradient with zeros and
    steps it, on one rank as on several), its cached device copy dropped (the next forward
    uploads it after the update); a late gradient onto a region holding an earlier step's
    gradients is added onto zeros."""
    from torch import nn

    from protrain.runtime.adam import AdamHyper, CPUAdamKernel
    from protrain.runtime.chunks import ChunkManager, ChunkState
    from protrain.runtime.optimizer import ChunkOptimizer, StepState
    from protrain.runtime.options import OptimizerSetup
    from protrain.runtime.streams import Streams
    dev = torch.device("cpu")
    streams = Streams(dev)
    params = [nn.Parameter(torch.zeros(64)) for _ in range(2)]
    m = ChunkManager(named_params=[(f"p{i}", p) for i, p in enumerate(params)], param_chunk=[0, 1],
                     chunk_parts=[(1, 1)] * 2, n_persist=0, n_buffer=1, chunk_capacity=64,
                     group_of={p: 0 for p in params}, device=dev, streams=streams,
                     grad_accumulation=False)
    kernel = CPUAdamKernel(adamw=True)
    opt = ChunkOptimizer(m, streams, OptimizerSetup(
                             param_groups=[{"params": params, "lr": 1e-3}], adamw=True,
                             hyper=lambda g: AdamHyper(g["lr"], 0.9, 0.999, 1e-8, 0.0, True, True),
                             grad_accumulation_steps=1, clip=1.0, loss_scaler=None,
                             speculate_chunks=0, host_thread=False),
                         host_kernel=kernel, device_kernel=kernel, params_in_order=params)
    opt.first_step_of_plan = False

    def backward(chunks):
        for c in chunks:                         # what chunk_backward_done's copy leaves
            opt._fresh.add(c.index)
            opt._host_grads(c).fill_(0.5)
            for s in c.slots:
                s.has_grad = True
        opt.step_state = StepState.BACKWARD
    a, b = m.chunks
    backward([a, b])
    opt.step()
    assert torch.all(opt._host_grads(b) != 0)   # scaled by the clipping, not zeroed after
    b_master, b_avg = b.master.clone(), b.exp_avg.clone()
    m.upload(b)
    m.access(b)
    m.release(b)                                 # b's parameters cached in the device buffer
    backward([a])                                # chunk b gets no gradient this step
    opt.step()
    assert torch.all(opt._host_grads(b) == 0)
    assert torch.equal(b.exp_avg, b_avg * 0.9)   # its moments decay: stepped on zeros
    assert not torch.equal(b.master, b_master) and b.slots[0].step == a.slots[0].step == 2
    assert b.state == ChunkState.HOST and m.pool.owner == [None]     # no stale copy to reuse
    assert opt.global_grad_norm == pytest.approx(0.5 * 64 ** 0.5, rel=1e-6)   # chunk a's only
    # a gradient arriving after its chunk left the device (the host path), onto a region that
    # still holds an earlier step's gradients: added onto zeros, not onto those
    backward([a])
    opt.step()
    assert torch.all(opt._host_grads(b) == 0)
    opt._host_grads(b).fill_(7.0)                # what an earlier step could have left there
    b.state = ChunkState.CACHED                  # its parameters still in a device buffer
    params[1].grad = torch.full((64,), 0.25)
    opt.on_grad(params[1])
    b.state = ChunkState.HOST
    assert torch.all(opt._host_grads(b) == 0.25) and 1 in opt._fresh
    opt.worker.close()
    m.close()


def test_the_probe_of_the_time_per_chunk_calls_no_collective(monkeypatch):
    """Only rank 0 probes while its peers wait for the plan: with a process group of several
    ranks running, the probe's step is a world of one (a collective would hang)."""
    import torch.distributed as dist

    from protrain.measure.update_overhead import measure_update_overhead
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    def collective(*a, **k):
        raise AssertionError("the probe called a collective")
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast"):
        monkeypatch.setattr(dist, name, collective)
    assert measure_update_overhead(reps=2) > 0
