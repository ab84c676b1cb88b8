"""AutoSP on this machine: the longest sequence that trains under one per-rank activation budget,
and time per token, for keep-all, full checkpointing, selective checkpointing and the planner's
own choice at P=1 and at P=2 (Ulysses sequence parallelism), on 2 gloo ranks.

Every system trains a Hugging Face Llama built from a config through an ordinary DeepSpeed loop
with ``"protrain"`` in its JSON; they differ only in what they pin:

- keep:     every block keeps its activations (n_checkpoint = n_selective = n_swap = 0), P=1;
- ckpt:     every block checkpointed, P=1;
- selective: every block under long-context selective checkpointing (attention kept), P=1;
- plan_p1:  the planner's choice with sequence_parallel pinned to 1 (data parallel);
- plan_p2:  the planner's choice with sequence_parallel pinned to 2.

Model states are pinned to one persistent chunk (no offloading) so every plan has the same
states S on the device, and the device budget is (S + activation budget) x (1 + margin): the
plans compete for one activation budget per rank. "Trains" means: the planner finds the plan
under the budget, and one training step runs with the runtime counting its device-resident
bytes (``accounting``), which must stay within the budget. The longest sequence is found by
doubling, then bisecting to a multiple of ``--granularity``. Then every system trains a few
steps at the longest sequence keep-all reaches (all can run it) and time per token is the
median step time over the global batch's tokens. Goals (issue 12): plan_p2 reaches >= 1.9x the
sequence of plan_p1; selective is faster per token than ckpt.

    python bench/sp_compare.py            # ~10-20 min on a 2-core CPU
    python bench/sp_compare.py --quick    # smaller budget and model (a check of the script)

Results: bench/results/sp_compare-cpu[-quick].json (command, machine, every probe, the
longest sequences, the times).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

SYSTEMS = {
    "keep": dict(n_checkpoint=0, n_selective=0, n_swap=0, sequence_parallel=1),
    "ckpt": dict(n_checkpoint="L", n_selective=0, n_swap=0, sequence_parallel=1),
    "selective": dict(n_checkpoint=0, n_selective="L", n_swap=0, sequence_parallel=1),
    "plan_p1": dict(sequence_parallel=1),
    "plan_p2": dict(sequence_parallel=2),
}


def _model(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=1 << 20,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def _batch(args, seq, step, rank):
    import torch
    g = torch.Generator().manual_seed(step * 1000 + rank)
    ids = torch.randint(0, args.vocab, (1, seq), generator=g)
    return ids, ids.clone()


def _engine(args, system, seq, budget_bytes=None):
    import deepspeed
    import torch
    pins = {k: (args.layers if v == "L" else v) for k, v in SYSTEMS[system].items()}
    torch.manual_seed(0)
    model = _model(args)
    params = sum(p.numel() for p in model.parameters())
    states = params * 16                       # fp32: parameter, gradient, Adam m and v
    device = budget_bytes or int((states + args.activation_budget) * 1.1)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 10**9,
          "protrain": {"enabled": True, "progress": False, "verbosity": 0, "accounting": True,
                       "device_memory": device, "chunk_size": params * 4, "n_persist": 1, **pins}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    return engine, device


def _train(args, system, seq, steps, rank):
    """Train ``steps`` steps at ``seq``; (plan facts, step times) or raises InfeasibleError."""
    import torch
    engine, budget = _engine(args, system, seq)
    times = []
    try:
        for step in range(steps):
            ids, labels = _batch(args, seq, step, rank)
            t0 = time.perf_counter()
            out = engine(input_ids=ids, labels=labels)
            engine.backward(out.loss)
            engine.step()
            times.append(time.perf_counter() - t0)
        rt, plan = engine.protrain_runtime, engine.protrain_plan
        facts = dict(modes="".join(m.letter for m in plan.block_modes), p=plan.knobs.sequence_parallel,
                     budget=budget, peak=rt.device_peak(), predicted_peak=plan.prediction.peak_device_bytes,
                     activation_peak=rt.accounting.activation_peak,
                     predicted_activation_peak=plan.prediction.activation_peak_bytes,
                     predicted_step=plan.prediction.step_time, loss=out.loss.item())
        return facts, times
    finally:
        engine.destroy()
        torch.distributed.barrier()


def _fits(args, system, seq, rank, log):
    from protrain.search import InfeasibleError
    try:
        facts, _ = _train(args, system, seq, 1, rank)
    except InfeasibleError as e:
        log.append(dict(system=system, seq=seq, fits=False, why=str(e).splitlines()[0][:300]))
        return False
    ok = facts["peak"] <= facts["budget"]
    log.append(dict(system=system, seq=seq, fits=ok, **facts))
    return ok


def _longest(args, system, rank, log) -> int:
    g = args.granularity
    lo, hi = 0, args.start
    while hi <= args.max_seq and _fits(args, system, hi, rank, log):
        lo, hi = hi, hi * 2
    hi = min(hi, args.max_seq + g)
    while hi - lo > g:
        mid = (lo + hi) // 2 // g * g
        if _fits(args, system, mid, rank, log):
            lo = mid
        else:
            hi = mid
    return lo


def run_rank(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    log: list[dict] = []
    longest = {}
    for system in args.systems:
        t0 = time.perf_counter()
        longest[system] = _longest(args, system, rank, log)
        if rank == 0:
            print(f"{system:<10} longest sequence {longest[system]:>7} tokens per sample "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    common = min(longest.values())
    timing = {}
    for system in args.systems:
        if not common:
            break
        facts, times = _train(args, system, common, args.warmup + args.steps, rank)
        step = sorted(times[args.warmup:])[len(times[args.warmup:]) // 2]
        timing[system] = dict(facts, step_times=times, step_median=step,
                              seconds_per_token=step / (common * world))
        if rank == 0:
            print(f"{system:<10} at {common} tokens: {step:.3f} s/step, "
                  f"{timing[system]['seconds_per_token'] * 1e6:.1f} us/token, modes {facts['modes']}",
                  flush=True)
    if rank == 0:
        p1, p2 = longest.get("plan_p1"), longest.get("plan_p2")
        sel, ck = timing.get("selective"), timing.get("ckpt")
        record = dict(
            command="python bench/sp_compare.py " + " ".join(sys.argv[1:]),
            machine=platform.processor() or platform.machine(), cores=os.cpu_count(),
            load_average=os.getloadavg(), world=world,
            model=dict(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                       vocab=args.vocab),
            activation_budget=args.activation_budget, longest=longest, common_seq=common,
            timing=timing,
            goals=dict(p2_over_p1=(p2 / p1) if p1 and p2 else None,
                       p2_over_p1_goal=1.9,
                       selective_over_ckpt_time=(sel["seconds_per_token"] / ck["seconds_per_token"])
                       if sel and ck else None),
            probes=log)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps(record["goals"]), flush=True)
        print(f"wrote {out}", flush=True)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--activation-budget", type=int, default=48 * 2**20,
                    help="per-rank device bytes for activations (default 48 MiB)")
    ap.add_argument("--start", type=int, default=512)
    ap.add_argument("--max-seq", type=int, default=32768)
    ap.add_argument("--granularity", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--quick", action="store_true", help="small budget and model: checks the script")
    ap.add_argument("--results-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    args.systems = args.systems.split(",")
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if args.quick:
        args.layers, args.hidden, args.activation_budget = 2, 64, 4 * 2**20
        args.start, args.granularity, args.steps, args.warmup = 256, 256, 2, 1
    out = Path(args.results_dir) / f"sp_compare-cpu{'-quick' if args.quick else ''}.json"
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    import torch.multiprocessing as mp
    from dpworker import free_port
    mp.start_processes(run_rank, args=(2, free_port(), args, str(out)), nprocs=2,
                       start_method="spawn", join=True)


if __name__ == "__main__":
    main()
