"""ProTrain vs DeepSpeed's offload configurations, side by side on one model.

Each system runs in its own process (a clean device), one after the other, with the same
model, batch and optimizer:

- protrain: ``"protrain": {"enabled": true}`` (the planner decides everything);
- protrain_keep_all: ProTrain with every chunk on the device (``"n_persist": "all"``) and
  every activation kept: what the planner's plan is compared with when memory is no issue;
- protrain_offload_all: ProTrain with every chunk offloaded (``"n_persist": 0``; needs
  ``--tie 0``, as tied embeddings must stay on the device), activations left to the planner;
- zero0: plain DeepSpeed, no ZeRO, no offload (the reference when the model fits);
- zero3_offload: ZeRO-3 with parameters and optimizer offloaded to CPU, DeepSpeed defaults;
- zero2_offload: ZeRO-2 with the optimizer offloaded to CPU.

For each: tokens/s and model TFLOPS over the timed steps (after warm-up steps, which include
ProTrain's profiling), peak device memory (max_memory_allocated / max_memory_reserved), and
for ProTrain the plan's predicted iteration time and peak, the bytes it moves per step and its
notes; the speed relative to zero0 and to zero3_offload. Results go to
bench/results/ds_compare-<device>-<tag>.json.

    python bench/ds_compare.py --layers 40 --hidden 3072 --heads 24 --micro-batch 4 --seq 1024 \
        --systems protrain,zero3_offload,zero2_offload                                   # GPU, 4.7B
    python bench/ds_compare.py --layers 8 --hidden 512 --heads 8 --vocab 1024 --seq 256 --micro-batch 4 \
        --tie 0 --rounds 3 --systems protrain,protrain_keep_all,zero0,protrain_offload_all,zero3_offload
    python bench/ds_compare.py --smoke                                                   # CPU check
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from free_port import free_port  # noqa: E402 - bench/ is on the path of its scripts

SYSTEMS = {
    "protrain": {"protrain": {"enabled": True, "progress": False}},
    "protrain_keep_all": {"protrain": {"enabled": True, "progress": False, "n_persist": "all",
                                       "n_checkpoint": 0, "n_swap": 0}},
    "protrain_offload_all": {"protrain": {"enabled": True, "progress": False, "n_persist": 0}},
    "zero0": {"zero_optimization": {"stage": 0}},
    "zero3_offload": {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                            "offload_optimizer": {"device": "cpu", "pin_memory": True}}},
    "zero2_offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}},
}


def worker(spec: dict, meter=None) -> dict:
    """Train ``spec['steps']`` steps of one system in this process and measure them; ``meter``
    (optional) is told ``start()`` before the engine is built, ``step(engine, step)`` after each
    step and ``finish(engine, out)`` at the end, to add its own measurements to ``out``."""
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())),
                 ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    import torch
    import deepspeed
    from protrain.models import GPT, GPTConfig, synthetic_batch

    cuda = torch.cuda.is_available()
    cfg = GPTConfig(n_layer=spec["layers"], n_embd=spec["hidden"], n_head=spec["heads"],
                    vocab_size=spec["vocab"], block_size=spec["seq"],
                    tie_embeddings=bool(spec.get("tie", 1)))
    ds = {"train_micro_batch_size_per_gpu": spec["micro_batch"], "gradient_accumulation_steps": 1,
          "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
          "steps_per_print": 10**9, **(spec.get("config") or SYSTEMS[spec["system"]])}
    if cuda:
        ds["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if meter is not None:
        meter.start()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    mb, seq = spec["micro_batch"], spec["seq"]
    losses, times = [], []
    for step in range(spec["warmup"] + spec["steps"]):
        x, y = synthetic_batch(cfg, mb, seq, device=engine.device, seed=step % 8)
        if cuda:
            torch.cuda.synchronize()
            if step == spec["warmup"]:
                # The peak of training, not of the warm-up (which includes ProTrain's profiling).
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        if step >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if meter is not None:
            meter.step(engine, step)
    step_time = sorted(times)[len(times) // 2]          # median
    tokens = mb * seq / step_time
    # 6 N per token for the matmuls plus causal attention (fwd 2 b s^2 h per layer, x3 with bwd)
    flops = 6 * n_params * mb * seq + 3 * 2 * mb * seq * seq * cfg.n_embd * cfg.n_layer
    out = dict(system=spec["system"], params=n_params, step_time_median=step_time,
               step_times=times, tokens_per_s=tokens, tflops=flops / step_time / 1e12,
               losses=losses)
    if cuda:
        out.update(max_memory_allocated=torch.cuda.max_memory_allocated(),
                   max_memory_reserved=torch.cuda.max_memory_reserved())
    plan = getattr(engine, "protrain_plan", None)
    if plan is not None:
        p = plan.prediction
        out.update(plan=plan.knobs.as_tuple(), block_modes="".join(m.letter for m in plan.block_modes),
                   predicted_iter_time=p.iter_time, predicted_peak=p.peak_device_bytes,
                   iter_time_error=(p.iter_time - step_time) / step_time,
                   bytes_moved=p.h2d_bytes + p.d2h_bytes + 2 * p.ssd_bytes, notes=list(plan.notes))
        rt = engine.protrain_runtime
        out.update(predicted_activation_peak=p.activation_peak_bytes, state_bytes=rt.chunks.device_bytes(),
                   ssd_backend=rt.activations.storage_backend, activation_stats=rt.activations.stats)
        if cuda:
            out["peak_error"] = (p.peak_device_bytes - out["max_memory_allocated"]) / out["max_memory_allocated"]
            # Device bytes above the chunks' (persistent states and buffers): activations and
            # transient buffers, the quantity the activation modes change.
            out["activation_peak"] = out["max_memory_allocated"] - out["state_bytes"]
    if meter is not None:
        meter.finish(engine, out)
    return out


def run_systems(specs: list[dict], script: str = __file__) -> list[dict]:
    """Run each spec (``system`` name, optional ``config`` replacing SYSTEMS[system], shape) in
    a fresh process of ``script`` (a bench whose ``parse`` runs ``--worker``), one after the
    other; a failure is recorded with its output's tail."""
    results = []
    for i, spec in enumerate(specs):
        spec = dict(spec, index=i)
        print(f"== {spec['system']}", flush=True)
        r = subprocess.run([sys.executable, script, "--worker", json.dumps(spec)],
                           capture_output=True, text=True)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode != 0 or not line:
            tail = (r.stdout + r.stderr)[-3000:]
            print(f"{spec['system']} failed (exit {r.returncode}):\n{tail}", flush=True)
            results.append(dict(system=spec["system"], error=tail))
            continue
        results.append(json.loads(line[0][len("RESULT "):]))
    return results


def write_record(name: str, tag: str, args, results: list[dict], **extra) -> Path:
    """<results dir>/<name>-<cuda|cpu>-<tag>.json with the command, device and versions."""
    import deepspeed
    import torch
    cuda = torch.cuda.is_available()
    from protrain.measure.probe import _cpu_model
    # Timings compare only on one machine: the CPU model says which (ratios move with its
    # compute-to-copy balance).
    device = torch.cuda.get_device_name(0) if cuda else f"cpu ({_cpu_model()})"
    record = dict(command=f"python bench/{name}.py " + " ".join(sys.argv[1:]), device=device,
                  torch=torch.__version__, deepspeed=deepspeed.__version__,
                  model=dict(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab),
                  micro_batch=args.micro_batch, seq=args.seq, **extra, results=results)
    out = Path(args.results_dir) / f"{name}-{'cuda' if cuda else 'cpu'}-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return out


def shape_args(ap: argparse.ArgumentParser, **defaults) -> None:
    """The model / batch flags both benchmarks take."""
    d = dict(layers=40, hidden=3072, heads=24, vocab=50304, seq=1024, micro_batch=4, steps=8, warmup=3,
             tie=1)
    d.update(defaults)
    for k, v in d.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    ap.add_argument("--smoke", action="store_true", help="tiny model, few steps (CPU check)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--results-dir", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)


def parse(ap: argparse.ArgumentParser, meter=None):
    """Parse the flags; in a worker process run the spec (measured also by ``meter(spec)``
    when given) and return None; with --smoke shrink the model to a CPU check."""
    args = ap.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        print("RESULT " + json.dumps(worker(spec, meter and meter(spec))), flush=True)
        return None
    if args.smoke:
        args.layers, args.hidden, args.heads, args.vocab, args.seq = 2, 64, 4, 256, 64
        args.micro_batch, args.steps, args.warmup = 2, 3, 1
    return args


def default_tag(args) -> str:
    return args.tag or ("smoke" if args.smoke else f"L{args.layers}H{args.hidden}b{args.micro_batch}s{args.seq}")


def shape_spec(args) -> dict:
    return dict(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                seq=args.seq, micro_batch=args.micro_batch, steps=args.steps, warmup=args.warmup,
                tie=args.tie)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape_args(ap)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the systems this many times, interleaved; each keeps its best round")
    args = parse(ap)
    if args is None:
        return
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        ap.error(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    # Several rounds, the systems interleaved, each system's best round kept: on a shared
    # machine a load spike during one system's run would otherwise decide the ratio.
    rounds = [run_systems([dict(system=s, **shape_spec(args)) for s in args.systems.split(",")])
              for _ in range(args.rounds)]
    results = []
    for i, name in enumerate(args.systems.split(",")):
        runs = [rnd[i] for rnd in rounds]
        good = [r for r in runs if "tokens_per_s" in r]
        best = max(good, key=lambda r: r["tokens_per_s"]) if good else runs[0]
        results.append(dict(best, rounds_tokens_per_s=[r.get("tokens_per_s") for r in runs]))
    ok = {r["system"]: r for r in results if "tokens_per_s" in r}
    ratios = {}
    for r in ok.values():
        for ref in ("zero0", "zero3_offload"):
            if ref in ok and r["system"] != ref:
                ratios[f"{r['system']}/{ref}"] = r["tokens_per_s"] / ok[ref]["tokens_per_s"]
    print(f"\n{'system':<21}{'tokens/s':>11}{'TFLOPS':>8}{'peak alloc':>12}{'vs ZeRO-0':>11}"
          f"{'vs ZeRO-3 off':>15}")
    for r in results:
        if "tokens_per_s" not in r:
            print(f"{r['system']:<21}{'failed':>11}")
            continue
        vs = [f"{ratios[k]:.2f}x" if k in ratios else "-" for k in
              (f"{r['system']}/zero0", f"{r['system']}/zero3_offload")]
        peak = f"{r['max_memory_allocated'] / 2**30:.1f} GiB" if "max_memory_allocated" in r else "-"
        print(f"{r['system']:<21}{r['tokens_per_s']:>11,.0f}{r['tflops']:>8.2f}{peak:>12}{vs[0]:>11}{vs[1]:>15}")
        if "predicted_iter_time" in r:
            pk = f", peak error {r['peak_error']:+.1%}" if "peak_error" in r else ""
            print(f"{'':<21}plan {r['plan']} {r['block_modes']}: predicted {r['predicted_iter_time']:.3f} s "
                  f"vs {r['step_time_median']:.3f} s measured ({r['iter_time_error']:+.1%}){pk}, "
                  f"moves {r['bytes_moved'] / 2**20:.1f} MiB/step")
            for note in r["notes"]:
                print(f"{'':<21}note: {note}")
    print(f"wrote {write_record('ds_compare', default_tag(args), args, results, ratios=ratios)}")


if __name__ == "__main__":
    main()
