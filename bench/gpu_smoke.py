"""The first command on any GPU (issue 35): a few minutes that exercise every CUDA-specific path
once and measure what the reviews could only read, so a 15-minute GPU lease ends with findings.

Sections (each in its own process with its own time limit, so a crash or a hang in one costs
only that one; the results of every finished section are on disk at once):

- build:     the native CPU Adam (csrc/) and DeepSpeed's CPUAdam op, compiled once, timed;
- tests:     tests/test_gpu_*.py on the device (storage, profiler, engine, selective);
- sanitizer: a tiny Llama (HF), bf16, a pinned plan with offloaded chunks and one block of each
             kind (checkpointed, swapped to host, on SSD), clipping, accumulation 2: 4 steps
             under TORCH_CUDA_SANITIZER=1 (stream races between kernels raise);
- syncs:     the same model and plan, 6 steps under torch.cuda.set_sync_debug_mode("warn"): the
             synchronizing calls per steady step and where they come from; losses against
             plain DeepSpeed ZeRO-0 bf16 on the same batches;
- tiers:     optimizer states of a chunk on NVMe and a block's activations on SSD: the store
             each tier chose and why;
- memory:    max_memory_allocated / reserved against the plan's predicted peak, then a real CUDA
             out-of-memory error in a forward and the re-plan that follows;
- compile:   engine.compile() (inductor) and 3 compiled steps, recompiles counted;
- worker:    the CPU Adam worker thread's OpenMP thread count after its first torch op, against
             the share it was given, and one 16-bit shadow copy's time at each count;
- profile:   a torch.profiler trace of 3 steady steps: the gap between step() and the next
             forward's first kernel, copies overlapping kernels, CPU Adam's exposed time
             against the plan's;
- headline:  the planner's plan against ZeRO-3 offload on a model whose states do not fit the
             device memory allowed (short: a few steps each).

The timing sections (worker, profile, headline) run alone; the others beside each other.

    bash bench/gpu_smoke.sh                       # on the GPU machine: installs, runs, $OUT
    python bench/gpu_smoke.py --dry-run           # the rehearsal on CPU: every section, tiny sizes
    python bench/gpu_smoke.py --only syncs,tiers  # some sections

Writes <out>/smoke.json (one entry per section: ok, seconds, result or the error's tail),
<out>/sections.tar.gz (each section's full output), <out>/trace.json.gz (the profile) and
<out>/headline_trace.json.gz (ProTrain's timed steps in the headline).
"""
from __future__ import annotations

import argparse
import collections
import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from free_port import free_port  # noqa: E402

# name: (time limit in s, runs alone, sections it waits for)
SECTIONS = {
    "build": (240, False, ()),
    "tests": (150, False, ()),
    "sanitizer": (150, False, ("build",)),
    "syncs": (120, False, ("build",)),
    "tiers": (90, False, ("build",)),
    "memory": (120, False, ("build",)),
    "compile": (150, False, ("build",)),
    "long_context": (120, False, ("build",)),
    "worker": (60, True, ("build",)),
    "profile": (90, True, ("build",)),
    "headline": (200, True, ("build",)),
}
ORDER = list(SECTIONS)


# ---- the workloads ---------------------------------------------------------------------------

def _dist_env() -> None:
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                 ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


LLAMA = dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
SEQ, MB = 256, 4


def tiny_llama(seed: int = 0):
    import torch
    import transformers
    cfg = transformers.LlamaConfig(**LLAMA, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def llama_batch(i: int, device):
    import torch
    g = torch.Generator().manual_seed(1000 + i)
    ids = torch.randint(3, LLAMA["vocab_size"], (MB, SEQ), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def ds_config(protrain: dict | None, *, gas: int = 2, clip: float = 1.0) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": gas,
           "gradient_clipping": clip, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "steps_per_print": 10**9}
    if protrain is not None:
        section = {"enabled": True, "progress": False, "verbosity": 1, **protrain}
        if not _cuda():
            section.setdefault("device_memory", "1GiB")     # CPU: no capacity to measure
        cfg["protrain"] = section
    return cfg


def _largest(model) -> int:
    """The smallest chunk size that holds every parameter: the most chunks, most offloaded."""
    return max(p.numel() * p.element_size() for p in model.parameters())


def pinned_plan(model, ssd_dir: str) -> dict:
    """Offloaded chunks (one kept), and one block of each kind: checkpointed, swapped, on SSD."""
    return {"chunk_size": _largest(model), "n_persist": 1, "n_checkpoint": 1, "n_swap": 1, "n_ssd": 1,
            "ssd_path": ssd_dir, "ssd_min_bytes": 0}


def build_engine(config: dict, model=None):
    _dist_env()
    import deepspeed
    model = model if model is not None else tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def micro_steps(engine, steps: int, first: int = 0, around=None) -> list:
    """``steps`` optimizer steps (gas micro-steps each) on llama batches; the losses as tensors
    (read at the end: no sync per step). ``around(step, phase)`` is a context manager factory."""
    import contextlib
    losses = []
    gas = engine.gradient_accumulation_steps()
    for s in range(first, first + steps):
        for m in range(gas):
            b = llama_batch(s * gas + m, engine.device)
            ctx = (lambda ph: around(s, ph)) if around else (lambda ph: contextlib.nullcontext())
            with ctx("forward"):
                loss = engine(**b).loss
            with ctx("backward"):
                engine.backward(loss)
            with ctx("step"):
                engine.step()
            losses.append(loss.detach().float().clone())
    return losses


def plan_summary(engine) -> dict:
    plan = getattr(engine, "protrain_plan", None)
    if plan is None:
        return {"engine": type(engine).__name__}
    p, rt = plan.prediction, engine.protrain_runtime
    return {"engine": type(engine).__name__, "knobs": plan.knobs.as_tuple(),
            "block_modes": "".join(m.letter for m in plan.block_modes),
            "offloaded_chunks": len(rt.chunks.offloaded()), "chunks": len(rt.chunks.chunks),
            "predicted_iter_time": p.iter_time, "predicted_peak": p.peak_device_bytes,
            "predicted_cpu_adam_exposed": p.cpu_optim_exposed, "notes": list(plan.notes)}


def section_build(out: Path) -> dict:
    """Compile the native CPU Adam and DeepSpeed's CPUAdam (each is built once per machine)."""
    import torch
    t = time.perf_counter()
    from protrain import native
    native.cpu_adam()
    t_native = time.perf_counter() - t
    t = time.perf_counter()
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])
    return {"native_cpu_adam_s": t_native, "deepspeed_cpu_adam_s": time.perf_counter() - t}


def section_tests(out: Path) -> dict:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_gpu_*.py"))
    # pytest writes into this section's log as it goes (a section stopped at its time limit
    # keeps what ran: the second GPU run's captured output was lost so), and a JUnit file.
    xml = out / "gpu_tests.xml"
    rc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rA", "-p", "no:cacheprovider",
                         "-o", "addopts=", f"--junitxml={xml}", *files], cwd=ROOT).returncode
    import xml.etree.ElementTree as ET
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = kind
    return {"exit": rc, "outcomes": outcomes}


def section_sanitizer(out: Path) -> dict:
    import torch
    enabled = False
    if os.environ.get("TORCH_CUDA_SANITIZER"):
        from torch.cuda import _sanitizer
        enabled = bool(getattr(_sanitizer, "cuda_sanitizer", None) and _sanitizer.cuda_sanitizer.enabled)
    model = tiny_llama()
    engine = build_engine(ds_config(pinned_plan(model, _ssd_dir(out, "sanitizer"))), model)
    losses = micro_steps(engine, 4)
    _sync(engine.device)
    res = {"sanitizer_enabled": enabled, "losses": [x.item() for x in losses], **plan_summary(engine)}
    engine.destroy()
    return res


def _ssd_dir(out: Path, name: str) -> str:
    base = Path(os.environ.get("PROTRAIN_SSD_DIR", out / "ssd"))
    d = base / name
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


class SyncCounter:
    """Counts torch's "called a synchronizing CUDA operation" warnings (sync debug mode) and
    the innermost frame of ProTrain, DeepSpeed or transformers that led to each."""

    KEYS = ("/protrain/", "/protrain_ds/", "/deepspeed/", "/transformers/")

    def __init__(self):
        self.total = 0
        self.sites = collections.Counter()
        self.phases = collections.Counter()
        self.phase = "?"

    def install(self):
        import warnings
        self._orig = warnings.showwarning
        warnings.simplefilter("always")

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return self._orig(message, category, filename, lineno, file, line)
            self.total += 1
            self.phases[self.phase] += 1
            site = "?"
            for f in reversed(traceback.extract_stack()[:-1]):
                if any(k in f.filename for k in self.KEYS) and "gpu_smoke" not in f.filename:
                    site = f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} {f.name}"
                    break
            self.sites[site] += 1
        warnings.showwarning = show
        return self


def section_syncs(out: Path) -> dict:
    import contextlib
    import torch
    warm, steady = 2, 4
    model = tiny_llama()
    engine = build_engine(ds_config(pinned_plan(model, _ssd_dir(out, "syncs"))), model)
    losses = micro_steps(engine, warm)
    counter = SyncCounter().install()

    @contextlib.contextmanager
    def phase(step, name):
        counter.phase = name
        yield

    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    losses += micro_steps(engine, steady, first=warm, around=phase)
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
    counter.phase = "after"
    pt = [x.item() for x in losses]
    res = {**plan_summary(engine), "steady_steps": steady, "syncs_total": counter.total,
           "syncs_per_step": counter.total / steady, "syncs_by_phase": dict(counter.phases),
           "sync_sites": counter.sites.most_common(25), "stats": engine.protrain_stats()}
    engine.destroy()
    res["losses"] = pt
    print("PARTIAL " + json.dumps(res, default=str), flush=True)     # kept if the reference fails
    ref_engine = build_engine(ds_config(None), tiny_llama())
    ref = [x.item() for x in micro_steps(ref_engine, warm + steady)]
    rel = [abs(a - b) / abs(b) for a, b in zip(pt, ref)]
    res.update(deepspeed_zero0_losses=ref, max_rel_loss_diff=max(rel),
               losses_match_within_bf16=max(rel) <= 1e-2)
    return res


def section_tiers(out: Path) -> dict:
    model = tiny_llama()
    plan = dict(pinned_plan(model, _ssd_dir(out, "tiers")), n_nvme=1)
    engine = build_engine(ds_config(plan), model)
    losses = micro_steps(engine, 3)
    _sync(engine.device)
    rt = engine.protrain_runtime
    nvme = getattr(rt.chunks, "nvme", None)
    res = {**plan_summary(engine), "losses": [x.item() for x in losses],
           "ssd_activation_store": rt.activations.storage_backend,
           "nvme_state_store": nvme.backend if nvme is not None else None,
           "activation_stats": rt.activations.stats, "stats": engine.protrain_stats()}
    try:
        import kvikio
        import kvikio.cufile_driver as driver
        import kvikio.defaults as defaults
        res["kvikio"] = {"version": kvikio.__version__,
                         "compat_mode_preferred": defaults.is_compat_mode_preferred(),
                         "gds_available": driver.get("is_gds_available")}
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        res["kvikio"] = f"{type(e).__name__}: {e}"
    engine.destroy()
    return res


def _gpt(layers: int, hidden: int, heads: int, vocab: int, seq: int):
    import torch
    from protrain.models import GPT, GPTConfig
    cfg = GPTConfig(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, block_size=seq,
                    tie_embeddings=False)
    torch.manual_seed(0)
    return cfg, GPT(cfg)


def _gpt_steps(engine, cfg, mb, steps, first=0, around=None):
    import contextlib
    from protrain.models import synthetic_batch
    losses = []
    for i in range(first, first + steps):
        x, y = synthetic_batch(cfg, mb, cfg.block_size, device=engine.device, seed=i % 8)
        ctx = (lambda ph: around(i, ph)) if around else (lambda ph: contextlib.nullcontext())
        with ctx("forward"):
            loss = engine(x, y)
        with ctx("backward"):
            engine.backward(loss)
        with ctx("step"):
            engine.step()
        losses.append(loss.detach().float().clone())
    return losses


def _mid(cuda: bool):
    return (dict(layers=6, hidden=1024, heads=16, vocab=8192, seq=1024, mb=4) if cuda else
            dict(layers=4, hidden=64, heads=4, vocab=256, seq=64, mb=2))


def _gpt_config(mb: int, section: dict, clip: float = 1.0) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": mb, "gradient_clipping": clip, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
           "steps_per_print": 10**9}
    if section is not None:
        cfg["protrain"] = {"enabled": True, "progress": False, "verbosity": 1, **section}
        if not _cuda():
            cfg["protrain"].setdefault("device_memory", "1GiB")
    return cfg


class ForcedOOM:
    """A real allocation the device cannot serve, in one block's forward (its pre-hook): the
    CUDA out-of-memory error a user gets, raised where the runtime has copies in flight."""

    def __init__(self, block):
        self.armed, self.fired = False, 0
        block.register_forward_pre_hook(self._pre)

    def _pre(self, module, args):
        import torch
        if self.armed and torch.is_grad_enabled():
            self.armed = False
            self.fired += 1
            if args[0].device.type == "cuda":
                torch.empty(1 << 50, dtype=torch.uint8, device=args[0].device)   # 1 PiB
            raise torch.OutOfMemoryError("out of memory (smoke: no CUDA device to exhaust)")


def section_memory(out: Path) -> dict:
    import torch
    cuda = _cuda()
    shape = _mid(cuda)
    cfg, model = _gpt(shape["layers"], shape["hidden"], shape["heads"], shape["vocab"], shape["seq"])
    oom = ForcedOOM(model.blocks[1] if hasattr(model, "blocks") else list(model.modules())[3])
    pins = {"chunk_size": _largest(model), "n_persist": 2, "n_swap": 1, "n_checkpoint": 1}
    engine = build_engine(_gpt_config(shape["mb"], pins), model)
    _gpt_steps(engine, cfg, shape["mb"], 1)            # profiling and planning: not measured
    res = dict(plan_summary(engine), shape=shape)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() - engine.protrain_runtime.chunks.device_bytes()
    losses = _gpt_steps(engine, cfg, shape["mb"], 3, first=1)
    if cuda:
        torch.cuda.synchronize()
        alloc, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        pred = engine.protrain_plan.prediction.peak_device_bytes
        res.update(max_memory_allocated=alloc, max_memory_reserved=reserved, base_not_planned=base,
                   predicted_peak=pred, peak_error=(pred - (alloc - base)) / (alloc - base),
                   peak_error_raw=(pred - alloc) / alloc)
    before = plan_summary(engine)
    runtime_before = id(engine.protrain_runtime)
    oom.armed = True
    t = time.perf_counter()
    losses += _gpt_steps(engine, cfg, shape["mb"], 3, first=4)
    res.update(oom_fired=oom.fired, replanned=id(engine.protrain_runtime) != runtime_before,
               replan_s=time.perf_counter() - t, plan_before_oom=before.get("knobs"),
               plan_after_oom=plan_summary(engine).get("knobs"), losses=[x.item() for x in losses])
    res["losses_finite"] = all(x == x and abs(x) < 1e4 for x in res["losses"])
    engine.destroy()
    return res


def section_long_context(out: Path) -> dict:
    """Issue 36's pieces on the device: a tiny Llama at a long sequence, every block
    checkpointed with its input in host memory, the head and the MLPs (with their norms) over
    tiles, against the same plan untiled: losses (bf16: within its error), the peak allocated
    against the prediction, the tiled memory passes through the CUDA allocator."""
    import torch
    cuda = _cuda()
    seq, head, mlp = (4096, 512, 1024) if cuda else (256, 64, 64)
    pins = {"chunk_size": _largest(tiny_llama()), "n_persist": 1, "n_checkpoint": LLAMA["num_hidden_layers"],
            "n_swap": 0, "n_ssd": 0, "n_selective": 0, "ckpt_input": "host"}
    res = {"seq": seq}
    for name, tiles in (("untiled", {"head_tile": 0, "mlp_tile": 0}), ("tiled", {"head_tile": head, "mlp_tile": mlp})):
        model = tiny_llama()
        engine = build_engine(ds_config(dict(pins, **tiles), gas=1), model)
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(3, LLAMA["vocab_size"], (1, seq), generator=g).to(engine.device)
        losses = []
        for step in range(3):
            if cuda and step == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() - engine.protrain_runtime.chunks.device_bytes()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float().clone())
        r = dict(plan_summary(engine), losses=[x.item() for x in losses],
                 mlp_with_norm=engine.protrain_plan.mlp_with_norm)
        if cuda:
            torch.cuda.synchronize()
            alloc = torch.cuda.max_memory_allocated()
            pred = engine.protrain_plan.prediction.peak_device_bytes
            r.update(max_memory_allocated=alloc, base_not_planned=base, predicted_peak=pred,
                     peak_error=(pred - (alloc - base)) / (alloc - base))
        res[name] = r
        engine.destroy()
    a, b = res["untiled"]["losses"], res["tiled"]["losses"]
    res["loss_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(b, a))
    return res


def section_compile(out: Path) -> dict:
    import torch
    cuda = _cuda()
    shape = _mid(cuda)
    cfg, model = _gpt(shape["layers"], shape["hidden"], shape["heads"], shape["vocab"], shape["seq"])
    pins = {"chunk_size": _largest(model), "n_persist": 2, "n_checkpoint": 1}
    engine = build_engine(_gpt_config(shape["mb"], pins), model)
    torch._logging.set_logs(recompiles=True, graph_breaks=True)
    engine.compile(backend="inductor" if cuda else "aot_eager")
    from torch._dynamo.utils import counters
    times, losses = [], []
    for i in range(3):
        t = time.perf_counter()
        losses += _gpt_steps(engine, cfg, shape["mb"], 1, first=i)
        _sync(engine.device)
        times.append(time.perf_counter() - t)
        if i == 0:
            graphs_after_first = dict(counters["stats"])
    res = dict(plan_summary(engine), step_s=times, losses=[x.item() for x in losses],
               dynamo_stats_after_first=graphs_after_first, dynamo_stats=dict(counters["stats"]),
               recompiles=sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
               graph_breaks=dict(counters["graph_break"]))
    engine.destroy()
    return res


def section_worker(out: Path) -> dict:
    import torch
    model = tiny_llama()
    engine = build_engine(ds_config(pinned_plan(model, _ssd_dir(out, "worker"))), model)
    micro_steps(engine, 2)
    opt = engine.protrain_runtime.optimizer
    share = getattr(opt.host_kernel, "threads", None)
    from protrain.runtime.host_threads import set_thread_count, thread_count
    n = 16 << 20
    probe: dict = {}

    def shadow_copy_s() -> float:
        src, dst = torch.randn(n), torch.empty(n, dtype=torch.bfloat16)
        dst.copy_(src)
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            dst.copy_(src)
            ts.append(time.perf_counter() - t)
        return sorted(ts)[2]

    def on_worker():
        probe["worker_threads"] = thread_count()
        probe["worker_torch_threads"] = torch.get_num_threads()
        probe["shadow_copy_s_at_worker_count"] = shadow_copy_s()
        if share:
            set_thread_count(share)
            probe["shadow_copy_s_at_share"] = shadow_copy_s()
            probe["worker_threads_after_set"] = thread_count()
    opt.worker.submit(on_worker)
    opt.worker.drain()
    res = {"share_given": share, "cpu_count": os.cpu_count(), "main_threads": thread_count(),
           "worker_threaded": opt.worker.threaded, "shadow_copy_bytes_fp32": 4 * n, **probe}
    res["worker_count_kept"] = bool(share) and probe.get("worker_threads") == share
    engine.destroy()
    return res


def _trace_analysis(events: list, steady: int) -> dict:
    """From a Kineto chrome trace: per step followed by another, the gap from the end of step() (CPU) to the
    next forward's first device kernel; copies' time and the share of it under a kernel."""
    ann = [e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("smoke.")]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    copies = [(e["ts"], e["ts"] + e["dur"], e.get("name", "")) for e in events if e.get("cat") == "gpu_memcpy"]
    gaps = []
    steps = sorted((e["ts"] + e["dur"]) for e in ann if e["name"] == "smoke.step")
    fwds = sorted(e["ts"] for e in ann if e["name"] == "smoke.forward")
    for end in steps:
        nxt = [f for f in fwds if f >= end]
        if not nxt:
            continue
        first = next((k[0] for k in kernels if k[0] >= nxt[0]), None)
        if first is not None:
            gaps.append({"step_end_to_forward_call_us": nxt[0] - end,
                         "step_end_to_first_forward_kernel_us": first - end})
    # the union of kernel intervals, then each copy's overlap with it
    merged: list = []
    for s, e in kernels:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    import bisect
    starts = [m[0] for m in merged]
    copy_us = overlap_us = 0.0
    by_kind = collections.Counter()
    for s, e, name in copies:
        copy_us += e - s
        by_kind[name.split(" ")[1] if " " in name else name] += e - s
        i = max(0, bisect.bisect_right(starts, s) - 1)
        while i < len(merged) and merged[i][0] < e:
            overlap_us += max(0.0, min(e, merged[i][1]) - max(s, merged[i][0]))
            i += 1
    kernel_us = sum(e - s for s, e in merged)
    return {"gaps": gaps, "kernel_busy_us": kernel_us, "copy_us": copy_us,
            "copy_under_kernel_share": overlap_us / copy_us if copy_us else None,
            "copy_us_by_kind": dict(by_kind), "n_kernels": len(kernels), "n_copies": len(copies)}


def section_profile(out: Path) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    cuda = _cuda()
    shape = _mid(cuda)
    cfg, model = _gpt(shape["layers"], shape["hidden"], shape["heads"], shape["vocab"], shape["seq"])
    pins = {"chunk_size": _largest(model), "n_persist": 2}
    engine = build_engine(_gpt_config(shape["mb"], pins), model)
    _gpt_steps(engine, cfg, shape["mb"], 3)
    _sync(engine.device)
    exposed = []

    import contextlib

    @contextlib.contextmanager
    def around(step, ph):
        with record_function(f"smoke.{ph}"):
            yield
        if ph == "step":
            exposed.append(engine.protrain_stats()["cpu_adam_exposed_s"])

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        # a fourth step, so that the third one's step()-to-forward gap is seen
        _gpt_steps(engine, cfg, shape["mb"], 4, first=3, around=around)
        _sync(engine.device)
    wall = time.perf_counter() - t
    path = out / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    with gzip.open(out / "trace.json.gz", "wt") as f:
        json.dump(trace, f)
    path.unlink()
    res = dict(plan_summary(engine), shape=shape, wall_3_steps_s=wall, cpu_adam_exposed_s=exposed,
               **_trace_analysis(trace.get("traceEvents", []), 3))
    engine.destroy()
    return res


def section_headline(out: Path) -> dict:
    """The plan against ZeRO-3 offload, each in its own process under the same device cap."""
    cuda = _cuda()
    if cuda:
        shape = dict(layers=16, hidden=2048, heads=16, vocab=32000, seq=1024, micro_batch=4, tie=0,
                     steps=3, warmup=2)
        cap_gib = 12
    else:
        shape = dict(layers=2, hidden=64, heads=4, vocab=256, seq=64, micro_batch=2, tie=0, steps=2,
                     warmup=1)
        cap_gib = 1
    res = {"shape": shape, "device_cap_gib": cap_gib, "systems": {}}
    for system, conf in (("protrain", {"protrain": {"enabled": True, "progress": False,
                                                     "device_memory": f"{cap_gib}GiB"}}),
                         ("zero3_offload", {"zero_optimization": {
                             "stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                             "offload_optimizer": {"device": "cpu", "pin_memory": True}}})):
        spec = dict(shape, system=system, config=conf, cap_gib=cap_gib, out=str(out))
        r = subprocess.run([sys.executable, __file__, "--headline-worker", json.dumps(spec)],
                           capture_output=True, text=True, env=dict(os.environ, MASTER_PORT=str(free_port())))
        print(r.stdout[-6000:], r.stderr[-6000:])
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        res["systems"][system] = (json.loads(line[-1][7:]) if r.returncode == 0 and line else
                                  {"error": (r.stdout + r.stderr)[-3000:]})
    s = res["systems"]
    if all("tokens_per_s" in v for v in s.values()):
        res["protrain_over_zero3_offload"] = s["protrain"]["tokens_per_s"] / s["zero3_offload"]["tokens_per_s"]
    return res


class _TraceTimedSteps:
    """ds_compare.worker's meter: a torch.profiler trace of the timed steps of a ProTrain run
    (kernel time, copies under kernels, CPU Adam's exposed time per step), and the plan's
    predicted breakdown, to see where the measured step parts from the predicted one."""

    def __init__(self, spec: dict, out_dir: Path):
        self.spec, self.out_dir, self.prof, self.exposed = spec, out_dir, None, []

    def start(self):
        pass

    def step(self, engine, step):
        from torch.profiler import ProfilerActivity, profile
        if getattr(engine, "protrain_plan", None) is None:
            return
        if step >= self.spec["warmup"]:
            self.exposed.append(engine.protrain_stats()["cpu_adam_exposed_s"])
        if step == self.spec["warmup"] - 1:
            import torch
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()

    def finish(self, engine, out):
        plan = getattr(engine, "protrain_plan", None)
        if plan is None or self.prof is None:
            return
        _sync(engine.device)
        self.prof.__exit__(None, None, None)
        path = self.out_dir / "headline_trace.json"
        self.prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        with gzip.open(self.out_dir / "headline_trace.json.gz", "wt") as f:
            json.dump(trace, f)
        path.unlink()
        a = _trace_analysis(trace.get("traceEvents", []), self.spec["steps"])
        p = plan.prediction
        out.update(cpu_adam_exposed_s=self.exposed, trace=dict(a, gaps=None),
                   kernel_busy_per_step_s=a["kernel_busy_us"] / 1e6 / self.spec["steps"],
                   predicted_breakdown_s=dict(fwd=p.fwd_time, bwd=p.bwd_time, gpu_adam=p.gpu_optim_time,
                                              cpu_adam=p.cpu_optim_time, cpu_adam_exposed=p.cpu_optim_exposed))


def headline_worker(spec: dict) -> dict:
    import torch
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_gib"] * 2**30 / total))
    from ds_compare import worker
    meter = _TraceTimedSteps(spec, Path(spec["out"])) if spec["system"] == "protrain" else None
    out = worker(spec, meter)
    out["params_bytes_zero0_would_hold"] = out["params"] * 16      # bf16 weights+grads, fp32 master+Adam
    return out


# ---- the driver ------------------------------------------------------------------------------

def run_section(name: str, out: Path) -> None:
    """In the section's own process: run it, print RESULT <json>."""
    fn = globals()[f"section_{name}"]
    print(f"RESULT {json.dumps(fn(out), default=str)}", flush=True)


def drive(names: list[str], out: Path, deadline: float, dry_run: bool) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "sections"
    logs.mkdir(exist_ok=True)
    results: dict = {"command": "python bench/gpu_smoke.py " + " ".join(sys.argv[1:]), "sections": {}}
    try:
        import deepspeed
        import torch
        results.update(torch=torch.__version__, deepspeed=deepspeed.__version__, cuda=torch.version.cuda,
                       device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    except Exception as e:  # noqa: BLE001
        results["versions_error"] = repr(e)
    pending = [n for n in ORDER if n in names]
    running: dict = {}
    done: set = set()

    def save():
        (out / "smoke.json").write_text(json.dumps(results, indent=1, default=str) + "\n")

    while pending or running:
        now = time.time()
        for name, (proc, started, limit, log) in list(running.items()):
            rc = proc.poll()
            if rc is None and now - started < limit:
                continue
            if rc is None:
                proc.kill()
                proc.wait()
            log.close()
            text = (logs / f"{name}.log").read_text(errors="replace")
            line = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
            entry = {"seconds": round(time.time() - started, 1), "exit": proc.returncode,
                     "ok": rc == 0 and bool(line)}
            partial = [ln for ln in text.splitlines() if ln.startswith("PARTIAL ")]
            if entry["ok"]:
                entry["result"] = json.loads(line[-1][7:])
            else:
                if partial:
                    entry["partial"] = json.loads(partial[-1][8:])
                entry["error"] = ("timed out after %d s; " % limit if rc is None else "") + text[-4000:]
            results["sections"][name] = entry
            print(f"== {name}: {'ok' if entry['ok'] else 'FAILED'} in {entry['seconds']} s", flush=True)
            if not entry["ok"]:
                print(entry["error"][-2500:], flush=True)
            else:
                print(json.dumps(entry["result"], default=str)[:2500], flush=True)
            save()
            del running[name]
            done.add(name)
        for name in list(pending):
            limit, alone, after = SECTIONS[name]
            if any(a in pending or a in running for a in after if a in names):
                continue
            if (alone and running) or any(SECTIONS[r][1] for r in running):
                break                  # the timing sections run by themselves, in order
            left = deadline - time.time()
            if left < 20:
                results["sections"][name] = {"ok": False, "error": "not run: the smoke's time was spent"}
                pending.remove(name)
                continue
            env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
            if name == "sanitizer" and not dry_run:
                env["TORCH_CUDA_SANITIZER"] = "1"      # CSAN needs CUDA (on CPU: the workload only)
            log = open(logs / f"{name}.log", "w")
            proc = subprocess.Popen([sys.executable, __file__, "--section", name, "--out", str(out)],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            running[name] = (proc, time.time(), min(limit, left - 5), log)
            pending.remove(name)
            print(f"-- {name} started", flush=True)
        time.sleep(0.5)
    save()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(logs, arcname="sections")
    (out / "sections.tar.gz").write_bytes(buf.getvalue())
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/protrain-smoke")
    ap.add_argument("--only", default=",".join(ORDER), help="comma-separated sections")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("SMOKE_BUDGET_S", 400)),
                    help="seconds for all sections together (the set-up before is not counted)")
    ap.add_argument("--dry-run", action="store_true",
                    help="on CPU: every section on tiny sizes (the rehearsal; CUDA-only checks say so)")
    ap.add_argument("--section", help=argparse.SUPPRESS)
    ap.add_argument("--headline-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.headline_worker:
        print("RESULT " + json.dumps(headline_worker(json.loads(args.headline_worker)), default=str), flush=True)
        return
    if args.section:
        run_section(args.section, Path(args.out))
        return
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(names) - set(SECTIONS)
    if unknown:
        ap.error(f"--only: unknown {sorted(unknown)}; sections: {', '.join(ORDER)}")
    if not args.dry_run and not _cuda():
        ap.error("no CUDA device: rehearse with --dry-run")
    results = drive(names, Path(args.out), time.time() + args.budget, args.dry_run)
    failed = [n for n, e in results["sections"].items() if not e.get("ok")]
    print(f"smoke: {len(results['sections']) - len(failed)} of {len(results['sections'])} sections ok"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
