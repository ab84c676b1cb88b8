"""The largest model `protrain plan` fits, by the number of layers of one shape (llama2-70b's
layer: hidden 8192, 64 heads, 8 KV heads, FFN 28672; micro-batch 1, sequence 2048), on
`--gpu a100-80gb --host-memory 1TiB` (one node), with one rank and with four - and four with
every device chunk whole (`--pin n_shard=0`), as before sharded persistent chunks.

The ProTrain paper reports 75 B parameters on one A100-80GB and 87 B on four with 1 TiB of host
memory; issue 37 measured 81 B for both before chunks on the device were sharded over the ranks.
Offline (analytic profiles): runs anywhere; on a 2-core machine 36 s for one rank, 4-8 minutes
for each four-rank case (a plan that does not fit is diagnosed across the sequence-parallel
degrees: 15-50 s each).

    python bench/largest_model.py [--out bench/results/largest_model.json]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

SHAPE = ["--hidden", "8192", "--heads", "64", "--kv-heads", "8", "--ffn-hidden", "28672", "--seq", "2048"]
MACHINE = ["--gpu", "a100-80gb", "--host-memory", "1TiB"]
CASES = {"one rank": ["--world", "1"], "four ranks": ["--world", "4"],
         "four ranks, n_shard=0": ["--world", "4", "--pin", "n_shard=0"]}


def plan(layers: int, extra: list[str]) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "protrain.cli", "plan", *MACHINE, "--layers", str(layers), *SHAPE, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode == 0, r.stdout + r.stderr


def largest(extra: list[str], lo: int = 60, hi: int = 200) -> dict:
    """Bisect the layer count: ``lo`` must fit, ``hi`` must not."""
    assert plan(lo, extra)[0] and not plan(hi, extra)[0], (lo, hi, extra)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan(mid, extra)[0] else (lo, mid)
    out = plan(lo, extra)[1]
    params = float(re.search(r"([\d.]+) B params", out).group(1))
    knobs = {k: int(v) for k, v in re.findall(r"^  (n_persist|n_shard|n_buffer)\s+(\d+)", out, re.M)}
    return {"layers": lo, "params_billion": params, "knobs": knobs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/largest_model.json")
    args = ap.parse_args()
    rows = {}
    for name, extra in CASES.items():
        t = time.perf_counter()
        found = largest(extra)
        rows[name] = dict(found, command=" ".join(["protrain plan", *MACHINE, *extra, "--layers",
                                                   str(found["layers"]), *SHAPE]))
        print(f"{name:24s} {rows[name]['layers']} layers, {rows[name]['params_billion']} B parameters "
              f"{rows[name]['knobs']} ({time.perf_counter() - t:.0f} s)", flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python bench/largest_model.py", "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
