"""Activation peak and throughput: keep every activation vs full checkpointing vs SSD blocks.

One model whose activations dominate (default ~1B GPT, long sequence), trained through the
DeepSpeed engine with ``"protrain"`` in four configurations, each in its own process, one after
the other (bench/ds_compare.py's harness):

- keep: no block checkpointed, swapped or on SSD (the activation peak to beat);
- ckpt: every block checkpointed (recompute);
- ssd_all: every block's saved tensors on NVMe (SSDTrain, with forwarding and dedup);
- ssd_plan: the planner's choice with the SSD tier enabled, under a device budget of the keep
  plan's predicted model states plus ``--budget-fraction`` of its predicted activation peak
  (the planner weighs SSD against checkpointing and swap with the measured NVMe bandwidth).

Model-state knobs are left to the planner (the model fits, so its chunks stay on the device).
For each: tokens/s, TFLOPS, peak allocated device memory over the timed steps, the activation
peak (that minus the chunks' bytes), the backend that did the I/O (kvikio GDS / compat, or
POSIX) and the plan's predictions. Goal (issue): ssd_* >= 45% below keep's activation peak at
<= 5% throughput loss. Results go to bench/results/ssd_compare-<device>-<tag>.json.

    python bench/ssd_compare.py --ssd-path /path/on/nvme                  # GPU, ~1B, seq 4096
    python bench/ssd_compare.py --smoke --ssd-path /tmp                   # CPU check
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from ds_compare import default_tag, parse, run_systems, shape_args, shape_spec, write_record  # noqa: E402


def _protrain(**extra) -> dict:
    return {"protrain": {"enabled": True, "progress": False, **extra}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape_args(ap, layers=16, hidden=2048, heads=16, seq=4096, micro_batch=2, steps=6, warmup=3)
    ap.add_argument("--ssd-path", required=True, help="directory on the NVMe drive to test")
    ap.add_argument("--budget-fraction", type=float, default=0.5,
                    help="ssd_plan's device budget: states + this fraction of keep's activation peak")
    ap.add_argument("--systems", default="keep,ckpt,ssd_all,ssd_plan")
    args = parse(ap)
    if args is None:
        return
    if not 0 < args.budget_fraction < 1:
        ap.error(f"--budget-fraction {args.budget_fraction}: give a fraction between 0 and 1")
    ssd = dict(ssd_path=args.ssd_path, ssd_min_bytes=0 if args.smoke else 2**20)
    fixed = {
        "keep": _protrain(n_checkpoint=0, n_swap=0, n_ssd=0),
        "ckpt": _protrain(n_checkpoint=args.layers, n_swap=0, n_ssd=0),
        "ssd_all": _protrain(n_checkpoint=0, n_swap=0, n_ssd=args.layers, **ssd),
    }
    wanted = args.systems.split(",")
    unknown = set(wanted) - set(fixed) - {"ssd_plan"}
    if unknown:
        ap.error(f"--systems: unknown {sorted(unknown)}; choose from keep, ckpt, ssd_all, ssd_plan")
    shape = shape_spec(args)
    results = run_systems([dict(system=s, config=fixed[s], **shape) for s in wanted if s in fixed])
    keep = next((r for r in results if r["system"] == "keep" and "tokens_per_s" in r), None)
    if "ssd_plan" in wanted:
        if keep is None:
            results.append(dict(system="ssd_plan", error="needs a successful keep run for its budget"))
        else:
            states = keep["predicted_peak"] - keep["predicted_activation_peak"]
            budget = int(states + args.budget_fraction * keep["predicted_activation_peak"])
            results += run_systems([dict(system="ssd_plan", config=_protrain(device_memory=budget, **ssd),
                                         **shape)])
            results[-1]["device_memory_budget"] = budget
    print(f"\n{'system':<10}{'tokens/s':>11}{'vs keep':>9}{'act. peak':>11}{'vs keep':>9}"
          f"{'modes':>8}  backend")
    for r in results:
        if "tokens_per_s" not in r:
            print(f"{r['system']:<10}{'failed':>11}")
            continue
        speed = f"{r['tokens_per_s'] / keep['tokens_per_s']:.2f}x" if keep else "-"
        act = r.get("activation_peak")
        act_s = f"{act / 2**30:.2f} GiB" if act is not None else "-"
        rel = (f"{act / keep['activation_peak'] - 1:+.0%}"
               if act is not None and keep and keep.get("activation_peak") else "-")
        print(f"{r['system']:<10}{r['tokens_per_s']:>11,.0f}{speed:>9}{act_s:>11}{rel:>9}"
              f"{r['block_modes'][:8]:>8}  {r.get('ssd_backend') or '-'}")
    print(f"wrote {write_record('ssd_compare', default_tag(args), args, results, ssd_path=args.ssd_path)}")


if __name__ == "__main__":
    main()
