"""How well the profile + cost models predict the profiled model's own runs.

Profiles the built-in GPT, then runs forward + backward with 0, half and all blocks
checkpointed (torch's non-reentrant checkpoint; SWAP needs the runtime of the engine issue)
and compares, for each, the predicted activation peak and forward+backward time with what the
device measured. On CUDA the peak is torch.cuda.max_memory_allocated above the level before
the step (parameters already resident, gradients dropped as the profiler does); on CPU it is
the profiler's own storage accounting (a smoke run of the script).

    python bench/profile_accuracy.py --model gpt-1b --micro-batch 8 --seq 1024   # on a GPU
    python bench/profile_accuracy.py --model gpt-tiny --micro-batch 4            # CPU smoke

Writes bench/results/profile_accuracy-<device>-<model>.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from protrain.block_mode import layout_block_modes
from protrain.cost.memory import activation_walk
from protrain.models import GPT, PRESETS, synthetic_batch
from protrain.profile.meter import OpRecorder, StorageMeter, StorageRegistry
from protrain.profile.tracer import drop_param_grads, profile_model
from protrain.runtime.activations import checkpointed_blocks


def run_step(model, x, y, modes, device, reps=3):
    """fwd+bwd with the given block modes: (peak activation bytes, best wall seconds)."""
    with checkpointed_blocks(model.transformer.h, modes), drop_param_grads(model.parameters()):
        best = float("inf")
        for _ in range(reps + 1):  # first run warms up
            sync(device)
            t0 = time.perf_counter()
            model(x, y).backward()
            sync(device)
            best = min(best, time.perf_counter() - t0)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            model(x, y).backward()
            sync(device)
            peak = torch.cuda.max_memory_allocated(device) - base
        else:
            reg = StorageRegistry("cpu")
            top = [0]
            with OpRecorder(reg, StorageMeter(reg), lambda n, b, pk, a: top.__setitem__(0, max(top[0], pk)),
                            {}, lambda i: None):
                model(x, y).backward()
            peak = top[0]
    return peak, best


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-1b", choices=list(PRESETS))
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = PRESETS[args.model]
    seq = args.seq or cfg.block_size
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=dtype)
    x, y = synthetic_batch(cfg, args.micro_batch, seq, device=device)
    t0 = time.perf_counter()
    prof = profile_model(model, lambda m: m(x, y), name=args.model, micro_batch=args.micro_batch,
                         seq_len=seq)
    profile_seconds = time.perf_counter() - t0
    n = prof.n_blocks
    rows = []
    for n_ckpt in sorted({0, n // 2, n}):
        modes = layout_block_modes(n, 0, n_ckpt)
        pred_peak = int(activation_walk(prof, np.array([[m.code for m in modes]]))[0][0])
        pred_time = sum(p.fwd_time + p.bwd_time for p in prof.parts) + \
            sum(b.fwd_time for b, m in zip(prof.blocks, modes) if m.value == "ckpt")
        peak, seconds = run_step(model, x, y, modes, device)
        rows.append(dict(n_checkpoint=n_ckpt, predicted_peak=pred_peak, measured_peak=int(peak),
                         peak_error=(pred_peak - peak) / peak, predicted_time=pred_time,
                         measured_time=seconds, time_error=(pred_time - seconds) / seconds))
    result = dict(
        command="python bench/profile_accuracy.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, model=args.model, params=prof.total_params, dtype=str(dtype),
        micro_batch=args.micro_batch, seq_len=seq, profile_seconds=profile_seconds,
        hooked_slowdown=prof.hooked_slowdown, rows=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"profile_accuracy-{device.type}-{args.model}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['device']}, {args.model} ({prof.total_params / 1e9:.2f} B params, {dtype}), "
          f"micro-batch {args.micro_batch}, seq {seq}; profiled in {profile_seconds:.1f} s")
    print(f"{'ckpt':>5} {'pred peak':>12} {'meas peak':>12} {'err':>7} {'pred s':>9} {'meas s':>9} {'err':>7}")
    for r in rows:
        print(f"{r['n_checkpoint']:>5} {r['predicted_peak'] / 2**20:>10.1f}Mi {r['measured_peak'] / 2**20:>10.1f}Mi "
              f"{r['peak_error']:>+7.1%} {r['predicted_time']:>9.4f} {r['measured_time']:>9.4f} {r['time_error']:>+7.1%}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
