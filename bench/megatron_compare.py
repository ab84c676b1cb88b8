"""Megatron-LM pretrain_gpt.py, unchanged, with --protrain-auto-memory next to Megatron's own
--recompute-granularity full and selective, in one run (GPU only).

    python bench/megatron_compare.py --megatron-lm /path/to/Megatron-LM   # core_v0.16.1 tree

Each configuration is one torchrun launch of pretrain_gpt.py with --mock-data on the same ~1B
GPT (24 layers, hidden 2048, 16 heads, seq 2048 by default). Reported per configuration: the
median "elapsed time per iteration" after warm-up, tokens/s (global batch x seq / time),
Megatron's TFLOP/s/GPU and its "max allocated" memory; for ProTrain also the predicted peak
and iteration time from the printed plan. Results go to bench/results/megatron-compare-*.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

CONFIGS = {
    "protrain": ["--protrain-auto-memory"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "selective": ["--recompute-granularity", "selective"],
}


def model_args(a) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads",
            str(a.heads), "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq),
            "--micro-batch-size", str(a.micro_batch), "--global-batch-size", str(a.micro_batch * a.nproc),
            "--train-iters", str(a.iters), "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine",
            "--bf16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257",
            "--log-interval", "1", "--log-throughput", "--eval-iters", "0", "--eval-interval", str(a.iters + 1),
            "--transformer-impl", a.impl, "--use-mcore-models", "--split", "1,0,0"]


def run(a, name: str, extra: list[str]) -> dict:
    cmd = ["torchrun", f"--nproc_per_node={a.nproc}", str(Path(a.megatron_lm) / "pretrain_gpt.py")] + \
        model_args(a) + extra
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([a.megatron_lm, os.environ.get("PYTHONPATH", "")]),
               CUDA_DEVICE_MAX_CONNECTIONS="1")
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    log = p.stdout + p.stderr
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    (Path(a.log_dir) / f"megatron-{name}.log").write_text(log)
    times = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", log)]
    tflops = [float(x) for x in re.findall(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)", log)]
    mem = [float(x) for x in re.findall(r"max allocated: ([\d.]+)", log)]
    out = {"config": name, "flags": extra, "returncode": p.returncode}
    if p.returncode != 0 or not times:
        out["error"] = log[-2000:]
        return out
    steady = times[a.warmup:] or times
    ms = statistics.median(steady)
    out.update(iter_ms=ms, tokens_per_s=a.micro_batch * a.nproc * a.seq / (ms / 1e3),
               tflops_per_gpu=statistics.median(tflops[a.warmup:] or tflops) if tflops else None,
               max_allocated_mib=max(mem) if mem else None)
    pred = re.search(r"predicted: iteration ([\d.]+) (ms|s)", log)
    peak = re.search(r"predicted peak device memory ([\d.]+) (GiB|MiB)", log)
    if pred:
        out["predicted_iter_ms"] = float(pred.group(1)) * (1e3 if pred.group(2) == "s" else 1)
    if peak:
        out["predicted_peak_mib"] = float(peak.group(1)) * (1024 if peak.group(2) == "GiB" else 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron-lm", required=True, help="Megatron-LM source tree (core_v0.16.1)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="iterations left out of the median")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--impl", default="auto", choices=["auto", "transformer_engine", "local"],
                    help="auto: transformer_engine when it is installed, else local")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--log-dir", default="bench/results/logs")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.impl == "auto":
        import importlib.util
        a.impl = "transformer_engine" if importlib.util.find_spec("transformer_engine") else "local"
    if not (Path(a.megatron_lm) / "pretrain_gpt.py").exists():
        sys.exit(f"--megatron-lm {a.megatron_lm}: no pretrain_gpt.py there; give a Megatron-LM checkout")
    rows = [run(a, n, CONFIGS[n]) for n in a.configs.split(",")]
    print(f"{'config':<10} {'ms/iter':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'max alloc MiB':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:<10} failed (rc {r['returncode']}), see {a.log_dir}")
            continue
        print(f"{r['config']:<10} {r['iter_ms']:>9.1f} {r['tokens_per_s']:>10.0f} "
              f"{(r['tflops_per_gpu'] or 0):>8.1f} {(r['max_allocated_mib'] or 0):>14.0f}")
    import torch
    gpu = torch.cuda.get_device_name(0).replace(" ", "-") if torch.cuda.is_available() else "cpu"
    out = Path(a.out or f"bench/results/megatron-compare-{gpu}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "gpu": gpu, "results": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
