"""The per-rank profile scaled from a short sequence (protrain.sp.scaling: time outside attention
by s, attention by s^2, bytes fitted through two profiles) against a profile measured at the
long sequence, on this machine.

    python bench/sp_scaling_accuracy.py

The built-in GPT (4 layers, width 256, 4 heads, micro-batch 2) is profiled at 256 and 512
tokens and scaled to 1024 and 2048, then profiled there; each profile is the best (lowest
total time) of ``--repeats`` measurements, since a 2-core CPU's timings wander. Reported per
target length: forward and backward time of the blocks and the activation peak, predicted
against measured. Writes bench/results/sp_scaling_accuracy-cpu.json. (The memory figures are
also checked by tests/test_sp_planner.py; timings are measured here, never in a unit test.)
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from protrain.models import GPT, GPTConfig, synthetic_batch
from protrain.measure.profiler import profile_model
from protrain.sp import scale_profile


def measure(cfg: GPTConfig, seq: int, repeats: int):
    best = None
    for _ in range(repeats):
        torch.manual_seed(0)
        model = GPT(cfg)
        x, y = synthetic_batch(cfg, 2, seq)
        p = profile_model(model, lambda m: m(x, y), progress=False, micro_batch=2, seq_len=seq)
        total = sum(b.fwd_time + b.bwd_time for b in p.blocks)
        if best is None or total < best[0]:
            best = (total, p)
    return best[1]


def figures(p) -> dict:
    return {"fwd_s": sum(b.fwd_time for b in p.blocks), "bwd_s": sum(b.bwd_time for b in p.blocks),
            "attn_fwd_s": sum(b.attn_fwd_time for b in p.blocks),
            "saved_bytes": sum(b.saved_bytes for b in p.blocks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=512, block_size=2048)
    short, half = measure(cfg, 512, args.repeats), measure(cfg, 256, args.repeats)
    rows = []
    for seq in (1024, 2048):
        predicted = figures(scale_profile(short, seq_len=seq, second=half))
        measured = figures(measure(cfg, seq, args.repeats))
        err = {k: predicted[k] / measured[k] - 1 for k in predicted if measured[k]}
        rows.append({"seq": seq, "predicted": predicted, "measured": measured, "error": err})
        print(f"seq {seq}: " + ", ".join(f"{k} {predicted[k]:.4g} vs {measured[k]:.4g} ({err[k]:+.1%})"
                                         for k in err))
    out = Path(__file__).parent / "results" / "sp_scaling_accuracy-cpu.json"
    out.write_text(json.dumps({"command": "python bench/sp_scaling_accuracy.py", "profiled_at": [256, 512],
                               "model": "GPT 4 x 256, 4 heads, micro-batch 2, fp32",
                               "cpu": platform.processor() or platform.machine(),
                               "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
