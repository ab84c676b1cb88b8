"""Exposed CPU Adam through the engine: measured (``engine.protrain_stats()``) against the
plan's prediction, with gradient clipping on and every chunk but one offloaded.

On a CPU "device" CPU Adam runs inline, so what is exposed is the updates left for after
backward: all of them when nothing speculates (the planner's choice here: no copy engine),
the ones whose speculation was undone otherwise. The prediction uses the probed CPU Adam rates;
each step's measurement is ``step()``'s wall time less the device Adam's.

Rates on a shared VM drift by 10-20% within minutes, so the bench runs ``--rounds`` rounds:
each measures the machine afresh (the probe the engine plans with, not its cache), predicts
the plan's exposed CPU Adam with it, then times ``--steps`` steps; the error reported is the
median over rounds.

    python bench/cpu_adam_exposed.py                    # 8 layers x 512, 12 steps
    python bench/cpu_adam_exposed.py --layers 12 --hidden 768 --steps 16 --save bench/results/cpu_adam_exposed-cpu.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from free_port import free_port  # noqa: E402 - bench/ is on the path of its scripts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of (fresh probe, prediction, --steps measured steps)")
    ap.add_argument("--chunk", default="4MiB")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--speculate", default="auto", help='"auto" (the planner) or a number of chunks')
    ap.add_argument("--host-thread", action="store_true",
                    help="CPU Adam on a worker thread on this CPU (run with OMP_NUM_THREADS=1: compute "
                         "and CPU Adam on a core each); the prediction models inline updates")
    ap.add_argument("--no-carry", action="store_true",
                    help="step() waits for every CPU Adam update (the behaviour before updates ran "
                         "into the next forward)")
    ap.add_argument("--cpu-adam", default="auto", choices=["auto", "native", "deepspeed"])
    ap.add_argument("--save", default=None)
    args = ap.parse_args(argv)

    import os
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                 ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)          # one process, no launcher
    import deepspeed
    import torch
    from protrain.models import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                    block_size=args.seq, tie_embeddings=False)
    section = {"enabled": True, "progress": False, "verbosity": 1, "chunk_size": args.chunk,
               "n_persist": 1, "n_checkpoint": 0, "n_swap": 0}
    section["cpu_adam"] = args.cpu_adam
    if args.host_thread:
        section["host_thread"] = True
    if args.speculate != "auto":
        section["speculate_chunks"] = int(args.speculate)
    ds = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
          "gradient_clipping": args.clip, "steps_per_print": 10**6,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
          "protrain": section}
    torch.manual_seed(0)
    model = GPT(cfg)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    from protrain.search import evaluate
    from protrain_ds.engine import _planner_config

    def run_steps(first: int, n: int) -> tuple[list, list]:
        exposed, steps = [], []
        for i in range(first, first + n):
            x, y = synthetic_batch(cfg, args.micro_batch, seed=i)
            t = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            if args.no_carry:
                engine.protrain_runtime.optimizer.carry_over = False
            if i >= args.warmup:
                steps.append(time.perf_counter() - t)
                exposed.append(engine.protrain_stats()["cpu_adam_exposed_s"])
        return exposed, steps

    run_steps(0, args.warmup)                      # plans, then warms up
    plan = engine.protrain_plan
    rounds = []
    for r in range(args.rounds):
        hw = engine._hardware(refresh=True)          # the machine as it runs now
        planner = _planner_config(engine, engine.protrain_runtime.chunks.dp)
        p = evaluate(engine.protrain_profile, hw, plan.knobs, planner).prediction
        # The same plan with the backups priced as copies (before the kernel took them in its
        # pass, HardwareProfile.backup_bandwidth): which pricing the measurement bears out.
        as_copy = (evaluate(engine.protrain_profile, replace(hw, backup_bandwidth=0.0), plan.knobs, planner).prediction
                   if hw.backup_bandwidth else None)
        speculated_before = engine.protrain_stats()["cpu_adam_overlapped_chunks"]
        exposed, steps = run_steps(args.warmup + r * args.steps, args.steps)
        # The runtime speculates only after a step that did not clip: where every step clipped
        # (no chunk's speculation committed in the round), the plan's unspeculated figures
        # are the prediction of what ran.
        speculated = engine.protrain_stats()["cpu_adam_overlapped_chunks"] > speculated_before
        unspec = plan.n_speculate and not speculated and p.iter_time_unspeculated
        rounds.append({"machine": hw.describe(), "speculated": bool(speculated),
                       "predicted_exposed_s": p.cpu_optim_exposed_unspeculated if unspec else p.cpu_optim_exposed,
                       "measured_exposed_s": statistics.median(exposed),
                       "predicted_iter_s": p.iter_time_unspeculated if unspec else p.iter_time,
                       "measured_iter_s": statistics.median(steps)})
        if as_copy is not None:
            rounds[-1].update(predicted_exposed_as_copy_s=as_copy.cpu_optim_exposed_unspeculated if unspec
                              else as_copy.cpu_optim_exposed,
                              predicted_iter_as_copy_s=as_copy.iter_time_unspeculated if unspec else as_copy.iter_time)
        rounds[-1]["exposed_error"] = rounds[-1]["predicted_exposed_s"] / rounds[-1]["measured_exposed_s"] - 1
        rounds[-1]["iter_error"] = rounds[-1]["predicted_iter_s"] / rounds[-1]["measured_iter_s"] - 1
        print(f"round {r}: exposed predicted {rounds[-1]['predicted_exposed_s'] * 1e3:.1f} ms"
              f"{' (nothing speculated: every step clipped)' if unspec else ''}, measured "
              f"{rounds[-1]['measured_exposed_s'] * 1e3:.1f} ms ({rounds[-1]['exposed_error']:+.1%}); "
              f"iteration {rounds[-1]['iter_error']:+.1%}", flush=True)
    out = {
        "command": "python bench/cpu_adam_exposed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": platform.node(), "cpu_count": __import__("os").cpu_count(),
        "params_m": sum(t.numel() for t in model.parameters()) / 1e6,
        "offloaded_chunks": len(engine.protrain_runtime.chunks.offloaded()),
        "n_speculate": plan.n_speculate,
        "rounds": rounds,
        "exposed_error": statistics.median(r["exposed_error"] for r in rounds),
        "iter_error": statistics.median(r["iter_error"] for r in rounds),
        "stats": engine.protrain_stats(),
    }
    engine.destroy()
    print(json.dumps(out, indent=1))
    if args.save:
        Path(args.save).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
