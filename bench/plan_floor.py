"""How far the chosen plans' predicted iteration is above the hardware's floor (issue 37).

For each case of a grid of ``protrain plan`` runs (H100 preset, Llama presets 7B-70B,
micro-batch, sequence length, with and without a drive), the plan's predicted iteration is
divided by its floor: the largest of

- device compute: every part's forward and backward plus the recompute the plan's block
  modes add, and the device Adam over the persistent chunks (at the machine's rate);
- each PCIe direction: the plan's bytes per iteration over the machine's bandwidth;
- CPU Adam: the offloaded chunks' parameters (this rank's shard) at the machine's rate,
  nothing else (no backup, no check, no verdict);
- the drive: its bytes both ways (activations, optimizer states) over its bandwidth: reads and
  writes share the drive's time (``HardwareProfile.nvme_duplex`` off, as for the presets).

The floor is computed here from the plan's own figures (its knobs, block modes, bytes moved)
and the profile's per-part times, by code independent of the cost model's scheduling: only a
plan that overlaps everything perfectly reaches it. A ratio well above 1 says where the plans
the planner can express (or the model's pricing) leave time on the table; the binding resource
says which. Planning only (CPU; no GPU needed).

    python bench/plan_floor.py                       # the full grid, a table, bench/results/plan_floor.json
    python bench/plan_floor.py --quick               # four cases (the CI smoke, tests/test_bench.py)
    python bench/plan_floor.py --models llama2-7b --save /tmp/floor-7b.json   # one preset's 24 cases
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODELS = ("llama2-7b", "llama3-8b", "llama2-13b", "llama2-70b")
MICRO_BATCHES = (1, 2, 4, 8)
SEQS = (2048, 4096, 8192)
DRIVES = (None, 12.0)           # no drive; a 12 GB/s NVMe drive (compatibility mode)
GPU = "h100-80gb"
HOST = "1TiB"
QUICK = [("llama2-7b", 4, 8192, None), ("llama2-13b", 8, 8192, None),
         ("llama2-13b", 2, 4096, 12.0), ("llama2-7b", 1, 2048, 12.0)]


EXPLAIN_ABOVE = 1.10
"""Cases whose ratio is above this are explained one by one (``explain``)."""


def plan_case(model: str, mb: int, seq: int, drive: float | None) -> dict | None:
    """The plan ``protrain plan`` prints for the case, as its JSON; None when nothing fits."""
    from protrain import cli
    argv = ["plan", "--model", model, "--micro-batch", str(mb), "--seq", str(seq), "--gpu", GPU,
            "--host-memory", HOST, "--json"]
    if drive:
        argv += ["--nvme", str(drive), "--nvme-free", "8TiB"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    if rc != 0:
        return None
    return json.loads(out.getvalue())


def floor_of(model: str, mb: int, seq: int, drive: float | None, plan: dict) -> dict:
    """The floor's terms (seconds) for the plan, and the binding one."""
    from protrain.block_mode import FULL_RECOMPUTE, SEL, BlockMode
    from protrain.layout import build_layout
    from protrain.profile.analytic import PRESETS, analytic_profile
    from protrain.profile.machines import DEFAULT_HOST_MEMORY, machine
    hw = machine(GPU).profile(host_memory=DEFAULT_HOST_MEMORY)
    shape = replace(PRESETS[model], micro_batch=mb, seq_len=seq)
    profile = analytic_profile(shape, hw)
    modes = [BlockMode(m).code for m in plan["block_modes"]]
    blocks = profile.blocks
    # Every fully recomputed block (its input kept on the device, in host memory or on the
    # drive) runs its forward again; a selective one its attention.
    recompute = sum(b.fwd_time for b, m in zip(blocks, modes) if m in FULL_RECOMPUTE) + \
        sum(b.sel_recompute_time for b, m in zip(blocks, modes) if m == SEL)
    compute = sum(p.fwd_time + p.bwd_time for p in profile.parts) + recompute
    knobs, pred = plan["knobs"], plan["prediction"]
    # The chunks' parameters as the plan's layout packs them (a chunk is rarely full).
    used = build_layout(profile, plan["chunks"]["chunk_numel"]).used
    persistent, offloaded = sum(used[:knobs["n_persist"]]), sum(used[knobs["n_persist"]:])
    compute += persistent / hw.gpu_adam_rate
    terms = {
        "device compute": compute,
        "H2D": pred["h2d_bytes"] / hw.h2d_bandwidth,
        "D2H": pred["d2h_bytes"] / hw.d2h_bandwidth,
        "CPU Adam": offloaded / hw.cpu_adam_rate,
    }
    if drive:
        # Activations written and read back, states read and written back: the drive's two
        # directions share its time (the preset's drive is not nvme_duplex).
        bw = drive * 1e9
        terms["drive"] = (2 * pred.get("ssd_bytes", 0) + pred.get("nvme_state_io_bytes", 0)) / bw
    binding = max(terms, key=terms.get)
    return {"terms": terms, "floor": terms[binding], "binding": binding}


LANES = {"device compute": "compute", "H2D": "h2d", "D2H": "d2h", "CPU Adam": "cpu_adam", "drive": "nvme"}
"""The predicted timeline's lane of each floor term's resource."""


def gap_of(plan: dict, binding: str, floor: float) -> dict:
    """Where the predicted iteration's time above the floor goes, read off the plan's predicted
    timeline on the binding resource's lane, folded onto one steady-state iteration [0, T) (the
    work a step carries into the next forward lands at the window's start, as it does from the
    step before): the lane's work beyond the floor's term (its busy time, and the kinds of work
    in it), and its idle time by phase - forward, backward, the step's end; when its first work
    starts, and how much of it runs past the iteration (into the next forward). ``extra +
    idle`` is the iteration minus the floor."""
    pred = plan["prediction"]
    t_iter = pred["iter_time"]
    fwd_end = pred["fwd_time"]
    bwd_end = fwd_end + pred["bwd_time"]
    lane = LANES[binding]
    pieces, kinds = [], {}
    events = [e for e in plan["timeline"]["events"] if e["lane"] == lane and e["end"] > e["start"]]
    for e in events:
        kinds[e["what"]] = kinds.get(e["what"], 0.0) + e["end"] - e["start"]
        a, b = e["start"], e["end"]
        while b > a:                             # folded: [a, b) cut at each multiple of T
            k = a // t_iter
            cut = min(b, (k + 1) * t_iter)
            pieces.append((a - k * t_iter, cut - k * t_iter))
            a = cut
    busy = _union(pieces)
    phases = {"forward": (0.0, fwd_end), "backward": (fwd_end, bwd_end), "step end": (bwd_end, t_iter)}
    idle = {name: max(0.0, (hi - lo) - _overlap(busy, lo, hi)) for name, (lo, hi) in phases.items()}
    busy_s = sum(b - a for a, b in busy)
    return {"lane": lane, "busy_s": busy_s, "extra_work_s": busy_s - floor,
            "work_by_kind_s": kinds, "idle_s": idle,
            "first_start_s": min((e["start"] for e in events), default=0.0),
            "carried_s": max(0.0, max((e["end"] for e in events), default=0.0) - t_iter)}


def _union(pieces: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(pieces):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(busy: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in busy)


def explain(r: dict) -> str:
    """One line: the binding lane's extra work and idle time (``gap_of``), in seconds."""
    g = r["gap"]
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(g["work_by_kind_s"].items(), key=lambda kv: -kv[1]))
    idle = ", ".join(f"{v:.2f} in {k}" for k, v in g["idle_s"].items() if v >= 0.005)
    return (f"{r['binding']} lane busy {g['busy_s']:.2f} s ({g['extra_work_s']:+.2f} over the floor's "
            f"{r['floor_s']:.2f}; {kinds}), idle {sum(g['idle_s'].values()):.2f} s"
            + (f": {idle}" if idle else "")
            + f"; its first work at {g['first_start_s']:.2f} s"
            + (f", {g['carried_s']:.2f} s of it carried into the next forward" if g["carried_s"] >= 0.005 else ""))


def run(cases, out: Path | None, progress: bool = False) -> dict:
    """Plan every case, each row printed as it is done with ``progress``; the JSON (``out``)
    rewritten after each case, so a run cut short keeps what it planned."""
    rows = []
    t0 = time.perf_counter()
    for k, (model, mb, seq, drive) in enumerate(cases):
        t_case = time.perf_counter()
        plan = plan_case(model, mb, seq, drive)
        if plan is not None:
            f = floor_of(model, mb, seq, drive, plan)
            it = plan["prediction"]["iter_time"]
            rows.append({"model": model, "micro_batch": mb, "seq": seq, "drive_gbps": drive,
                         "predicted_s": it, "floor_s": f["floor"], "ratio": it / f["floor"],
                         "binding": f["binding"], "terms_s": f["terms"],
                         "gap": gap_of(plan, f["binding"], f["floor"]),
                         "knobs": plan["knobs"], "plan_seconds": time.perf_counter() - t_case})
        if progress:
            print(f"[{k + 1}/{len(cases)}] " + (_row(rows[-1]) if plan is not None else
                                                f"{model} mb {mb} seq {seq} drive {drive}: no plan fits"),
                  flush=True)
        result = _summary(cases, rows, t0)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1))
    return result


def _summary(cases, rows, t0) -> dict:
    ratios = [r["ratio"] for r in rows]
    return {"command": "python " + " ".join(sys.argv), "gpu": GPU, "host_memory": HOST,
            "cases": len(cases), "feasible": len(rows),
            "median_ratio": statistics.median(ratios) if ratios else None,
            "max_ratio": max(ratios) if ratios else None,
            "seconds": time.perf_counter() - t0, "rows": rows}


def _row(r: dict) -> str:
    d = f"{r['drive_gbps']:.0f}" if r["drive_gbps"] else "-"
    return (f"{r['model']:<11} {r['micro_batch']:>2} {r['seq']:>5} {d:>5} "
            f"{r['predicted_s']:>9.3f}s {r['floor_s']:>8.3f}s {r['ratio']:>6.3f}  {r['binding']}")


def print_table(result: dict) -> None:
    print(f"{'model':<11} {'mb':>2} {'seq':>5} {'drive':>5} {'predicted':>10} {'floor':>9} "
          f"{'ratio':>6}  binding")
    for r in result["rows"]:
        print(_row(r))
    above = [r for r in result["rows"] if r["ratio"] > EXPLAIN_ABOVE]
    if above:
        print(f"\nabove {EXPLAIN_ABOVE}: where the time above the floor goes (seconds)")
        for r in above:
            print(f"{r['model']} mb {r['micro_batch']} seq {r['seq']} drive {r['drive_gbps'] or '-'} "
                  f"({r['ratio']:.3f}): {explain(r)}")
    if result["rows"]:
        print(f"{result['feasible']} feasible of {result['cases']} cases: predicted / floor median "
              f"{result['median_ratio']:.3f}, max {result['max_ratio']:.3f} "
              f"({result['seconds']:.0f} s of planning)")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="four cases (CI's smoke)")
    ap.add_argument("--save", default=None, help="JSON path (default bench/results/plan_floor.json; "
                                                 "--quick: none)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated presets of the grid")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    cases = QUICK if args.quick else list(itertools.product(models, MICRO_BATCHES, SEQS, DRIVES))
    out = Path(args.save) if args.save else (None if args.quick else
                                             Path(__file__).parent / "results" / "plan_floor.json")
    result = run(cases, out, progress=not args.quick)
    print_table(result)
    return result


if __name__ == "__main__":
    main()
