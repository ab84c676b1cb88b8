"""torch.compile with ProTrain: time per step compiled against eager, with an offloading plan,
beside plain DeepSpeed compiled against eager.

Four engines train the same GPT on the same batches in one process:

- protrain_eager / protrain_compiled: ProTrain with a pinned offloading plan (``--persist``
  leading chunks on the device, the rest streamed through buffers; one swapped and one
  checkpointed block), the second with ``engine.compile(backend)``: its blocks' forwards run
  compiled (protrain.runtime.compile);
- ds_eager / ds_compiled: plain DeepSpeed (ZeRO-0), the second with ``engine.compile(backend)``
  (DeepSpeed compiles the whole module).

Each engine first runs ``--warmup`` steps (profiling and planning for ProTrain, compiling for
the compiled ones: reported as ``warmup_s``). Then ``--rounds`` rounds, each timing
``--steps`` steps of every engine in turn (interleaved: on a shared machine a burst of load
hits all four alike); the time per step of an engine is the median over rounds of its
per-round median, in wall time and in this process's CPU time (which other processes' load
does not inflate: on a busy shared machine, with OMP_NUM_THREADS=1, the steadier measure). Step i of every engine uses batch i, so the losses are compared too: ProTrain
compiled against DeepSpeed compiled, and ProTrain eager against DeepSpeed eager.

    OMP_NUM_THREADS=1 python bench/compile_compare.py --rounds 6 --save bench/results/compile_compare-cpu.json
    OMP_NUM_THREADS=2 python bench/compile_compare.py --rounds 6 --save bench/results/compile_compare-cpu-2threads.json
    python bench/compile_compare.py --backend aot_eager --rounds 2 --steps 3      # quick check
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from free_port import free_port  # noqa: E402 - bench/ is on the path of its scripts

SYSTEMS = ("protrain_eager", "protrain_compiled", "ds_eager", "ds_compiled")


def build(name: str, args, cfg):
    import deepspeed
    import torch
    from protrain.models import GPT

    ds = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
          "steps_per_print": 10**6, "zero_optimization": {"stage": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
    if name.startswith("protrain"):
        ds["protrain"] = {"enabled": True, "progress": False, "verbosity": 0,
                          "chunk_size": args.chunk, "n_persist": args.persist,
                          "n_swap": 1, "n_checkpoint": 1}
    torch.manual_seed(0)
    model = GPT(cfg)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    if name.endswith("compiled"):
        engine.compile(backend=args.backend)
    return engine


def step(engine, cfg, args, i: int) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of this process, loss) of one optimizer step."""
    from protrain.models import synthetic_batch
    x, y = synthetic_batch(cfg, args.micro_batch, seed=i)
    t, c = time.perf_counter(), time.process_time()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - t, time.process_time() - c, loss.item()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--chunk", default="1MiB", help="chunk size (a block of the default GPT is ~3 MiB)")
    ap.add_argument("--persist", type=int, default=2, help="chunks kept on the device; the rest offloaded")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--save", default=None)
    args = ap.parse_args(argv)

    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                 ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)          # one process, no launcher
    import torch
    from protrain.models import GPTConfig

    cfg = GPTConfig(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                    vocab_size=args.vocab, block_size=args.seq, tie_embeddings=False)
    load_before = os.getloadavg()
    engines, losses, warmup = {}, {}, {}
    times, cpu = {s: [] for s in SYSTEMS}, {s: [] for s in SYSTEMS}
    for name in SYSTEMS:
        t = time.perf_counter()
        engines[name] = build(name, args, cfg)
        losses[name] = [step(engines[name], cfg, args, i)[2] for i in range(args.warmup)]
        warmup[name] = time.perf_counter() - t
        print(f"{name}: warm-up ({args.warmup} steps, planning / compiling) {warmup[name]:.1f} s", flush=True)
    i = args.warmup
    for r in range(args.rounds):
        for name in SYSTEMS:
            measured = [step(engines[name], cfg, args, i + k) for k in range(args.steps)]
            times[name].append(statistics.median(t for t, _, _ in measured))
            cpu[name].append(statistics.median(c for _, c, _ in measured))
            losses[name] += [loss for _, _, loss in measured]
        i += args.steps
        print(f"round {r}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.1f} ms (cpu {cpu[n][-1] * 1e3:.1f})"
                                         for n in SYSTEMS), flush=True)
    per_step = {n: statistics.median(times[n]) for n in SYSTEMS}
    cpu_step = {n: statistics.median(cpu[n]) for n in SYSTEMS}
    pt = engines["protrain_compiled"]
    out = {
        "command": "python bench/compile_compare.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "what": "time per optimizer step (median over rounds of each round's median), compiled vs "
                "eager, ProTrain with an offloading plan and plain DeepSpeed ZeRO-0, one process, "
                "interleaved rounds",
        "machine": platform.node(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "backend": args.backend, "params_m": sum(p.numel() for p in pt.module.parameters()) / 1e6,
        "plan": {"knobs": list(pt.protrain_plan.knobs.as_tuple()),
                 "modes": "".join(m.letter for m in pt.protrain_plan.block_modes),
                 "offloaded_chunks": len(pt.protrain_runtime.chunks.offloaded()),
                 "chunks": len(pt.protrain_runtime.chunks.chunks),
                 "compiled_blocks": pt.protrain_runtime.compiled.compiled},
        "warmup_s": warmup,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
        "step_s": per_step, "cpu_step_s": cpu_step,
        "rounds_step_s": times, "rounds_cpu_step_s": cpu,
        "speedup_compiled": {f"{sys_}_{kind}": t[f"{p}_eager"] / t[f"{p}_compiled"]
                             for kind, t in (("wall", per_step), ("cpu", cpu_step))
                             for sys_, p in (("protrain", "protrain"), ("deepspeed", "ds"))},
        "protrain_over_deepspeed": {f"{mode}_{kind}": t[f"protrain_{mode}"] / t[f"ds_{mode}"]
                                    for kind, t in (("wall", per_step), ("cpu", cpu_step))
                                    for mode in ("eager", "compiled")},
        "losses": losses,
        "max_loss_diff": {
            "protrain_compiled_vs_ds_compiled": max(abs(a - b) for a, b in
                                                    zip(losses["protrain_compiled"], losses["ds_compiled"])),
            "protrain_eager_vs_ds_eager": max(abs(a - b) for a, b in
                                              zip(losses["protrain_eager"], losses["ds_eager"]))},
    }
    for e in engines.values():
        e.destroy()
    print(json.dumps(out, indent=1))
    if args.save:
        Path(args.save).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
