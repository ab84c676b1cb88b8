"""How well the profile + cost models predict the profiled model's own runs.

Profiles the built-in GPT (or a block-shape model, ``--model shape-relu_tail`` etc., see
protrain/block_shapes.py), then runs forward + backward with 0, half and all blocks
checkpointed (torch's non-reentrant checkpoint) and compares, for each, the predicted
activation peak and forward+backward time with what was measured. The peak is measured with
two meters: the allocator (torch.cuda.max_memory_allocated above the level before the step on
CUDA; glibc's bytes in use, mallinfo2 after every op, on CPU) and, on CPU, the storage counter
the profile itself was taken with. Parameters are resident and gradients dropped as the
profiler does.

    python bench/profile_accuracy.py --model gpt-1b --micro-batch 8 --seq 1024   # on a GPU
    python bench/profile_accuracy.py --model gpt-small --micro-batch 1 --seq 512 # CPU
    python bench/profile_accuracy.py --model shape-relu_tail --micro-batch 2 --seq 512

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
from protrain.block_shapes import KINDS, ShapeConfig, ShapeNet, shape_batch
from protrain.measure.heap_peak import HeapPeak
from protrain.measure.profiler import drop_param_grads, profile_model
from protrain.profile.blocks import find_blocks
from protrain.runtime.activations import checkpointed_blocks
from protrain.runtime.meter import OpRecorder, StorageMeter, StorageRegistry


def run_step(model, blocks, x, y, modes, device, reps=3):
    """fwd+bwd with the given block modes: (allocator peak, storage-counter peak or None on
    CUDA, best wall seconds). Each meter gets an iteration of its own."""
    with checkpointed_blocks(blocks, modes), drop_param_grads(model.parameters()):
        best = float("inf")
        for _ in range(reps + 1):  # first run warms up
            sync(device)
            t0 = time.perf_counter()
            model(x, y).backward()
            sync(device)
            best = min(best, time.perf_counter() - t0)
        with HeapPeak(device) as heap:
            model(x, y).backward()
        counted = None
        if device.type != "cuda":
            reg = StorageRegistry("cpu")
            top = [0]
            with OpRecorder(reg, StorageMeter(reg), lambda n, b, pk, a: top.__setitem__(0, max(top[0], pk)),
                            {}, lambda i: None):
                model(x, y).backward()
            counted = top[0]
    return heap.peak, counted, best


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-1b", choices=list(PRESETS) + [f"shape-{k}" for k in KINDS])
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    if args.model.startswith("shape-"):
        # A block-shape model as wide as gpt-small, 6 blocks.
        cfg = ShapeConfig(kind=args.model[len("shape-"):], n_layer=6, n_embd=768, vocab_size=8192)
        seq = args.seq or 512
        model = ShapeNet(cfg).to(device=device, dtype=dtype)
        x, y = (t.to(device) for t in shape_batch(cfg, args.micro_batch, seq))
    else:
        cfg = PRESETS[args.model]
        seq = args.seq or cfg.block_size
        model = GPT(cfg).to(device=device, dtype=dtype)
        x, y = synthetic_batch(cfg, args.micro_batch, seq, device=device)
    _, blocks = find_blocks(model)
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
        heap, counted, seconds = run_step(model, blocks, x, y, modes, device)
        rows.append(dict(n_checkpoint=n_ckpt, modes="".join(m.letter for m in modes),
                         predicted_peak=pred_peak,
                         measured_peak=int(counted) if counted is not None else None,
                         peak_error=(pred_peak - counted) / counted if counted else None,
                         allocator_peak=int(heap), allocator_peak_error=(pred_peak - heap) / heap,
                         predicted_time=pred_time, measured_time=seconds,
                         time_error=(pred_time - seconds) / seconds))
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
    print("activation peak: predicted; storage counter (CPU: the profile's own meter); allocator "
          "(mallinfo2 on CPU, max_memory_allocated on CUDA)")
    print(f"{'modes':>8} {'pred':>11} {'counter':>11} {'err':>7} {'allocator':>11} {'err':>7} "
          f"{'pred s':>9} {'meas s':>9} {'err':>7}")
    for r in rows:
        counter = (f"{r['measured_peak'] / 2**20:>9.2f}Mi {r['peak_error']:>+7.2%}"
                   if r["measured_peak"] is not None else f"{'-':>11} {'-':>7}")
        print(f"{r['modes']:>8} {r['predicted_peak'] / 2**20:>9.2f}Mi {counter} "
              f"{r['allocator_peak'] / 2**20:>9.2f}Mi {r['allocator_peak_error']:>+7.2%} "
              f"{r['predicted_time']:>9.4f} {r['measured_time']:>9.4f} {r['time_error']:>+7.1%}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
