"""csrc/cpu_adam.cpp: DeepSpeed's SIMD Adam behind ProTrain's GIL-free binding. Built on first
use (about a minute on 2 cores, cached in TORCH_EXTENSIONS_DIR); same bits as DeepSpeedCPUAdam."""
import json

import pytest
import torch

from deferred_streams import deferred_streams
from dstrain import base_config, train, with_protrain
from test_ds_engine import SHAPES, deepspeed_run

from protrain import native


@pytest.fixture(scope="module")
def op():
    return native.cpu_adam()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_updates_equal_deepspeed_cpu_adam_bit_for_bit(op, dtype):
    """Sizes around the SIMD spans and the 64K tile, a scaled step, 16-bit gradients widened in
    the kernel, 1 to 3 threads (shares that end inside a tile, a last share with the scalar
    tail), a step with nothing to fuse; the backup holds the states from just before, the
    upload copy the updated master in its dtype, the gradients stay untouched."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    ds = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], adamw_mode=True)
    op.create(901, True)
    torch.manual_seed(0)
    for n in (1, 127, 129, 65536 * 2 + 77, 65536 * 3 + 4096 + 13):
        p, g = torch.randn(n), torch.randn(n).to(dtype)
        m, v = torch.randn(n).abs() * 0.01, torch.randn(n).abs() * 0.001
        ref = [p.clone(), m.clone(), v.clone()]
        got = [p.clone(), m.clone(), v.clone()]
        g_before = g.clone()
        for step, scale, threads in ((1, 1.0, 2), (2, 0.37, 3), (3, 1.0, 1), (4, 1.0, 3)):
            gg = g.float() * torch.tensor([scale]) if (dtype != torch.float32 or scale != 1.0) else g
            ds.ds_opt_adam.adam_update(ds.opt_id, step, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, *ref[:1], gg,
                                       *ref[1:])
            before = [t.clone() for t in got]
            backup = [torch.empty(n) for _ in range(3)] if step != 4 else []   # 4: nothing fused
            copy = torch.empty(n, dtype=torch.bfloat16 if dtype == torch.float32 else dtype)
            op.update(901, step, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, got[0], g, got[1], got[2], scale,
                      backup, copy if step in (2, 3) else None, threads)
            assert all(torch.equal(a, b) for a, b in zip(ref, got)), (n, step)
            assert all(torch.equal(a, b) for a, b in zip(backup, before)), (n, step)
            if step in (2, 3):
                assert torch.equal(copy, ref[0].to(copy.dtype)), (n, step)
            assert torch.equal(g, g_before)
    op.destroy(901)


def test_engine_with_the_native_kernel_and_speculation_trains_exactly_like_deepspeed(op, monkeypatch):
    """gradient_clipping 1.0 with norms around it: speculative updates with the fused backup,
    rollbacks restoring it, all through the native kernel on the worker thread."""
    model_cfg, pins = SHAPES["a mix"]
    clip = '{"gradient_clipping": 1.0}'
    ref_losses, ref_weights = deepspeed_run(model_cfg, clip, 20, loss_factor=0.6)
    with deferred_streams(monkeypatch):
        losses, weights, engine = train(
            with_protrain(base_config(**json.loads(clip)), **pins, speculate_chunks=99, cpu_adam="native"),
            model_cfg, 20, loss_factor=0.6)
    kernel = engine.protrain_runtime.optimizer.host_kernel
    stats = engine.protrain_stats()
    machine_line = engine.protrain_plan.machine
    engine.destroy()
    assert type(kernel).__name__ == "NativeCPUAdamKernel"
    # The backups priced as this kernel takes them: in its own pass, at the rate measured for it.
    assert "backup in the update" in machine_line, machine_line
    assert losses == ref_losses
    assert all(torch.equal(weights[n], w) for n, w in ref_weights.items())
    assert stats["cpu_adam_overlapped_chunks"] > 0 and stats["cpu_adam_rollbacks"] > 0


def test_a_failed_build_names_the_compiler_problem_and_the_way_around(monkeypatch):
    import torch.utils.cpp_extension as ext

    def failing(**kw):
        raise RuntimeError("Error building extension 'protrain_cpu_adam':\n"
                           "cpu_adam.cpp:1:10: fatal error: torch/extension.h: No such file\n"
                           "g++: error: compilation terminated")
    monkeypatch.setattr(ext, "load", failing)
    monkeypatch.setattr(native, "_loaded", {})
    with pytest.raises(native.NativeBuildError) as e:
        native.cpu_adam()
    msg = str(e.value)
    assert "C++17 compiler" in msg and "fatal error: torch/extension.h" in msg
    assert '"cpu_adam": "deepspeed"' in msg and "cpu_adam.cpp" in msg


@pytest.mark.parametrize("kind", ["deepspeed", "native", "torch", "torch fused"])
def test_every_kernel_takes_the_runtimes_call(kind):
    """One interface for the runtime's ``_update``: scale (a one-element tensor), whether the
    gradients may be scaled in place, a backup. Each kernel gives what it gives on gradients
    scaled beforehand, fills the backup with the states from before, and leaves read-only
    gradients untouched. (The device kernel on a GPU, torch's fused Adam, once got the native
    kernel's call and would have failed at its first step.)"""
    from protrain.runtime.adam import AdamHyper, CPUAdamKernel, NativeCPUAdamKernel, TorchAdamKernel
    make = {"deepspeed": lambda: CPUAdamKernel(adamw=True), "native": lambda: NativeCPUAdamKernel(True),
            "torch": lambda: TorchAdamKernel(fused=False), "torch fused": lambda: TorchAdamKernel(fused=True)}
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, bias_correction=True,
                  adamw=True)
    torch.manual_seed(0)
    n = 4099
    p, g = torch.randn(n), torch.randn(n)
    m, v = torch.randn(n).abs() * 0.01, torch.randn(n).abs() * 0.001
    scale = torch.tensor([0.37])
    ref = [t.clone() for t in (p, m, v)]
    make[kind]().update(ref[0], g * scale, ref[1], ref[2], 1, h)
    for writable in (False, True):
        got, grads = [t.clone() for t in (p, m, v)], g.clone()
        backup = [torch.empty(n) for _ in range(3)]
        make[kind]().update(got[0], grads, got[1], got[2], 1, h, scale=scale, grad_writable=writable,
                            backup=backup)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), (kind, writable)
        assert all(torch.equal(a, b) for a, b in zip(backup, (p, m, v)))
        if not writable:
            assert torch.equal(grads, g)


# A process that loads both kernels while a build killed midway has left its lock file behind
# (the lock is what torch.utils.cpp_extension's build holds; it waits on it with no end).
STALE_LOCK_LOADER = r"""
import pathlib, sys, threading
import torch
import deepspeed.ops.adam, deepspeed.ops.op_builder.cpu.cpu_adam  # not from two threads at once
from protrain import native
native.LOCK_WAIT_WARN_S = 1.0
real = native._build_dir
def killed_build_left_its_lock(*args):
    d = real(*args)
    pathlib.Path(d, "lock").touch()
    return d
native._build_dir = killed_build_left_its_lock
threading.Thread(target=native.cpu_adam, daemon=True).start()
if sys.argv[1] == "deepspeed-too":
    threading.Thread(target=native.deepspeed_cpu_adam_op, daemon=True).start()
threading.Event().wait()
"""


def test_a_stale_build_lock_is_named_within_seconds_instead_of_a_silent_wait(tmp_path):
    """Issue 25 §5: every load after a killed build used to wait forever, silently."""
    import os
    import queue
    import subprocess
    import sys
    import threading
    import time
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import CPUAdamBuilder
    # DeepSpeed's op is compiled on first use unless the install carries it prebuilt
    ds_jit = not installed_ops.get(CPUAdamBuilder.NAME, False)
    if ds_jit:
        (tmp_path / CPUAdamBuilder.NAME).mkdir()
        (tmp_path / CPUAdamBuilder.NAME / "lock").touch()
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", STALE_LOCK_LOADER, "deepspeed-too" if ds_jit else ""],
                            env=env, stderr=subprocess.PIPE, text=True)
    lines, want = queue.Queue(), 2 if ds_jit else 1
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stderr], daemon=True).start()
    said, seen = [], []
    try:
        deadline = time.monotonic() + 120         # the process never ends by itself
        while len(said) < want and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            seen.append(line)
            if "waited 1 s for the build lock" in line:
                said.append(line)
    finally:
        proc.kill()
        proc.wait()
    assert len(said) == want, "".join(seen)
    native_lock = next(tmp_path.glob("protrain_cpu_adam_*/lock"))
    mine = next(ln for ln in said if "native CPU Adam" in ln)
    assert str(native_lock) in mine and f"delete {native_lock}" in mine and "killed midway" in mine
    if ds_jit:
        theirs = next(ln for ln in said if "DeepSpeed's CPU Adam" in ln)
        assert str(tmp_path / CPUAdamBuilder.NAME / "lock") in theirs


@pytest.mark.parametrize("kind", ["deepspeed", "native"])
def test_runs_and_split_pieces_update_like_deepspeeds_per_tensor_calls(op, kind):
    """DeepSpeed's CPU Adam runs a call's last n % 16 elements in scalar code (other rounding)
    and DeepSpeed calls it per tensor. A run of parameters (a bias of 8 first: a router's)
    and the two pieces of a parameter cut by a shard boundary, updated as the chunk runtime
    splits them (optimizer._segments, adam.update_as_per_tensor, with a backup and a scale),
    give DeepSpeed's per-tensor bits; one plain call over the run does not."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from protrain.runtime.adam import AdamHyper, CPUAdamKernel, NativeCPUAdamKernel, update_as_per_tensor
    ds = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], adamw_mode=True)
    kernel = CPUAdamKernel(True) if kind == "deepspeed" else NativeCPUAdamKernel(True, threads=2)
    h = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, True)
    torch.manual_seed(0)
    sizes = (8, 64, 100, 48)
    states = [[torch.randn(n), torch.randn(n), torch.rand(n) * 0.01, torch.rand(n) * 1e-3] for n in sizes]
    scale = torch.tensor([0.37])
    ref = [[t.clone() for t in st] for st in states]
    for step in (1, 2):
        for p, g, m, v in ref:
            ds.ds_opt_adam.adam_update(ds.opt_id, step, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, p, g * scale, m, v)
    flat = [torch.cat([st[i] for st in states]) for i in range(4)]
    plain = [t.clone() for t in flat]
    for step in (1, 2):
        kernel.update(*plain[:1], plain[1].clone(), *plain[2:], step, h, scale=scale, grad_writable=True)
        # the chunk runtime's calls: the bias alone (its scalar tail), 64 + 100 (100's tail:
        # its last 4), and 48 cut at 21 by a shard boundary (two pieces, each padded/split)
        backup = [torch.empty_like(flat[0]) for _ in range(3)]
        before = [flat[0].clone(), flat[2].clone(), flat[3].clone()]
        for lo, hi, scalar_from in ((0, 8, 0), (8, 172, 160), (172, 193, 21), (193, 220, 27)):
            g = flat[1][lo:hi].clone()
            update_as_per_tensor(kernel, flat[0][lo:hi], g, flat[2][lo:hi], flat[3][lo:hi], step, h,
                                 scalar_from=scalar_from, scale=scale, grad_writable=False,
                                 backup=[b[lo:hi] for b in backup])
        assert all(torch.equal(a, b) for a, b in zip(backup, before))
    want = [torch.cat([st[i] for st in ref]) for i in (0, 2, 3)]
    assert all(torch.equal(a, b) for a, b in zip((flat[0], flat[2], flat[3]), want))
    assert not all(torch.equal(a, b) for a, b in zip((plain[0], plain[2], plain[3]), want))


def test_the_builders_cpu_query_runs_once_per_process_and_is_put_back(monkeypatch):
    """DeepSpeed's op builders ask py-cpuinfo for the compiler flags twice per JIT load (a 1.2 s
    subprocess each): inside cpu_info_once the query runs once, nested and overlapping uses
    share it, and the real function is back afterwards."""
    import cpuinfo
    from protrain import native
    calls = []

    def real():
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2"]}
    monkeypatch.setattr(cpuinfo, "get_cpu_info", real)
    monkeypatch.setattr(native, "_cpu_info", {})
    with native.cpu_info_once():
        with native.cpu_info_once():
            assert cpuinfo.get_cpu_info()["arch"] == "X86_64"
        cpuinfo.get_cpu_info()["flags"].append("changed")        # a copy: the memo stays
        assert cpuinfo.get_cpu_info()["flags"] == ["avx2"]
    assert cpuinfo.get_cpu_info is real and len(calls) == 1
