"""Planning time of the search on analytic profiles (CPU; planning never needs a GPU).

    python bench/plan_time.py                   # every case
    python bench/plan_time.py --states-on-drive # only the cases of issue 27 (their rows updated)
    python bench/plan_time.py --states-on-drive --baseline DIR   # and each beside a checkout DIR

Each model is planned for an H100 80 GB without an SSD tier, and with a 12 GB/s NVMe drive
under GPUDirect Storage and in compatibility mode (the SSD mode multiplies the candidates);
with gradient clipping off (CPU Adam overlaps backward) and on (DeepSpeed's default and
``protrain plan``'s: CPU Adam waits for the verdict, the search also picks how many chunks
speculate), and for llama2-13b also with 256 GiB of host memory (tens of thousands of plans
within a few per cent, bound by CPU Adam). And issue 27's case: llama2-70b at sequence 4096
with clipping, 256 GiB of host memory (its states need 854 GiB) and a 12 GB/s drive with 4 TiB
free in compatibility mode - the search puts most chunks' optimizer states on the drive
(n_nvme); and the same on 8 ranks of one node with 1 TiB of host memory, where the planner
also picks the sequence-parallel degree (``search_sequence_parallel``: a search per degree
its floor does not rule out); and issue 37's, each with a drive: llama2-70b with 1 TiB (3.2 M
candidates), a 206B shape (96 blocks of 12288) with 512 GiB, llama2-13b (``STATES_ON_DRIVE``).
Writes bench/results/plan_time.json: for each case the blocks,
the candidates (``Plan.candidates_total``), how many the search simulated, and the best of 3 wall times of
``search`` (``search_sequence_parallel`` on 8 ranks). ``--baseline DIR``: each row is also
timed with the protrain of checkout DIR (``baseline_seconds``): the two in turns, each run in
a fresh process, the best of 3 of each, and the plans checked equal (knobs, time, speculating
chunks; the runner-ups, notes and counts are kept for reading: the search may stop early among
ties and counts the candidates it never fitted).
"""
from __future__ import annotations

import itertools
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from protrain.config import PlannerConfig
from protrain.profile.analytic import PRESETS, analytic_profile
from protrain.profile.machines import machine
from protrain.search import search
from protrain.units import GiB

CASES = [("gpt2-1.5b", 8, 128), ("llama2-7b", 4, 128), ("llama2-13b", 4, 128), ("llama2-13b", 4, 256),
         ("gpt2-10b", 4, 512), ("llama2-70b", 1, 1024)]
CLIP = {"off": PlannerConfig(), "on": PlannerConfig(cpu_optim_overlap=False, cpu_optim_speculative=True)}


STATES_ON_DRIVE = [
    "--model llama2-70b --micro-batch 1 --seq 4096 --gpu h100-80gb --host-memory 256GiB --nvme 12 --nvme-free 4TiB",
    "--model llama2-70b --micro-batch 1 --seq 4096 --gpu h100-80gb --host-memory 1TiB --nvme 12 --nvme-free 4TiB "
    "--world 8 --ranks-per-node 8",
    "--model llama2-70b --micro-batch 1 --seq 4096 --gpu h100-80gb --host-memory 1TiB --nvme 12 --nvme-free 4TiB",
    "--layers 96 --hidden 12288 --heads 96 --micro-batch 1 --gpu h100-80gb --host-memory 512GiB --nvme 12 "
    "--nvme-free 16TiB",
    "--model llama2-13b --micro-batch 1 --gpu h100-80gb --nvme 12 --nvme-free 4TiB"]
"""Issue 27's cases, as ``protrain plan`` arguments (planned as the command plans them,
gradient clipping on by its default): one rank with 256 GiB of host memory (its states need
854 GiB), and 8 ranks of one node sharing 1 TiB, where the planner also picks the
sequence-parallel degree (``search_sequence_parallel``: a search per degree its floor does
not rule out). Then issue 37's (search time, each with a drive): llama2-70b with 1 TiB (3.2 M
candidates), a 206B shape (96 blocks of 12288) with 512 GiB, and llama2-13b."""


def _timed(plan_it, reps: int):
    best, plan = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        plan = plan_it()
        best = min(best, time.perf_counter() - t0)
    return plan, best


def _row(name: str, mb: int, host_gib: int, ssd: str, clip: str, reps: int = 3) -> dict:
    hw = machine("h100-80gb").profile(host_memory=host_gib * GiB)
    if ssd != "none":
        hw = replace(hw, nvme_write_bandwidth=12e9, nvme_read_bandwidth=12e9, nvme_gds=ssd == "gds",
                     nvme_free_bytes=2**40)
    shape = replace(PRESETS[name], micro_batch=mb)
    prof = analytic_profile(shape, hw)
    plan, best = _timed(lambda: search(prof, hw, CLIP[clip]), reps)
    print(f"{name:<11} host {host_gib:>4} GiB ssd {ssd:<6} clip {clip:<3} {prof.n_blocks:>3} blocks  "
          f"{plan.candidates_total:>7} candidates  {plan.candidates_evaluated:>6} simulated  {best * 1e3:7.1f} ms",
          file=sys.stderr)
    return dict(model=name, ssd=ssd, clip=clip, blocks=prof.n_blocks, micro_batch=mb, host_gib=host_gib,
                candidates=plan.candidates_total, simulated=plan.candidates_evaluated, seconds=best,
                knobs=plan.knobs.as_tuple(), n_speculate=plan.n_speculate, n_nvme=plan.knobs.n_nvme, n_shard=plan.knobs.n_shard,
                host_bytes=plan.prediction.host_bytes, step_time=plan.prediction.step_time, **_decided(plan))


def _decided(plan) -> dict:
    """What else the plan says of the search, for the comparison with a baseline: its
    runner-ups (knobs, time) and notes."""
    return dict(runner_ups=[[list(a.knobs.as_tuple()), a.iter_time] for a in plan.alternatives],
                notes=list(plan.notes), fastest=plan.fastest())


def _cli_row(arguments: str, reps: int = 3) -> dict:
    """``protrain plan ARGUMENTS`` planned as the command plans it, timed from the profile on
    (``search``, or ``search_sequence_parallel`` for several ranks)."""
    from protrain.cli import _analytic, _config, build_parser
    from protrain.runtime.node import OFFLINE_RANKS_PER_NODE
    args = build_parser().parse_args(["plan"] + arguments.split())
    config = _config(args)
    prof, hw = _analytic(args)
    hw = replace(hw, ranks_per_node=args.ranks_per_node or min(args.world, OFFLINE_RANKS_PER_NODE))
    if args.world > 1:
        from protrain.sp.planner import search_sequence_parallel
        config = replace(config, data_parallel_size=args.world)
        plan, best = _timed(lambda: search_sequence_parallel(prof, hw, config), reps)
    else:
        plan, best = _timed(lambda: search(prof, hw, config), reps)
    print(f"protrain plan {arguments}: {plan.candidates_total} candidates, {plan.candidates_evaluated} "
          f"simulated, {best:.2f} s, n_nvme {plan.knobs.n_nvme}, P={plan.knobs.sequence_parallel}",
          file=sys.stderr)
    return dict(model=args.model or f"{args.layers} x {args.hidden}", ssd="gds" if args.gds else "compat", clip="on", blocks=prof.n_blocks,
                micro_batch=args.micro_batch, host_gib=hw.host_memory // GiB, seq=args.seq, world=args.world,
                plan=arguments, candidates=plan.candidates_total, simulated=plan.candidates_evaluated,
                seconds=best, knobs=plan.knobs.as_tuple(), sequence_parallel=plan.knobs.sequence_parallel,
                n_speculate=plan.n_speculate, n_nvme=plan.knobs.n_nvme, n_shard=plan.knobs.n_shard,
                host_bytes=plan.prediction.host_bytes, step_time=plan.prediction.step_time, **_decided(plan))


def _in_process(row: list, tree: str) -> dict:
    """``_cli_row`` (``row``: [arguments]) or ``_row`` (its arguments) timed once, in a fresh
    process whose protrain is checkout ``tree``'s."""
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, __file__, "--row", json.dumps(row)], env=env, check=True,
                         capture_output=True, text=True)
    sys.stderr.write(f"[{tree}] " + out.stderr)
    return json.loads(out.stdout)


def _beside(row: list, baseline: str) -> dict:
    """The row timed here and with checkout ``baseline``'s protrain, in turns (3 each, every
    one in a fresh process: the machine is shared and its load drifts), the best of each; the
    baseline's plan must be the same."""
    here = str(Path(__file__).resolve().parents[1])
    runs = [(_in_process(row, baseline), _in_process(row, here)) for _ in range(3)]
    base, new = (min((r[k] for r in runs), key=lambda x: x["seconds"]) for k in (0, 1))
    # The plan must be the same; the runner-ups and notes may differ where the search stops
    # early (ties within its tolerance) or words them otherwise, and the counts where it prunes.
    same = ("knobs", "step_time", "n_speculate")
    if any(base[k] != new[k] for k in same):
        raise SystemExit(f"{row}: the baseline's plan differs: {base} against {new}")
    commit = subprocess.run(["git", "-C", baseline, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return dict(new, baseline_seconds=base["seconds"], baseline=commit or baseline,
                baseline_simulated=base["simulated"])


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--row"]:                       # one timing, for _in_process
        row = json.loads(argv[1])
        print(json.dumps(_cli_row(row[0], reps=1) if len(row) == 1 else _row(*row, reps=1)))
        return
    out = Path(__file__).parent / "results" / "plan_time.json"
    baseline = argv[argv.index("--baseline") + 1] if "--baseline" in argv else None
    if baseline:
        grid, cli = (lambda a: _beside(a, baseline)), (lambda a: _beside([a], baseline))  # noqa: E731
    else:
        grid, cli = (lambda a: _row(*a)), _cli_row  # noqa: E731
    if "--states-on-drive" in argv:                 # those rows alone, the others kept as measured
        rows = [r for r in json.loads(out.read_text())["rows"] if "seq" not in r]
    else:
        rows = [grid([n, m, h, s, c]) for (n, m, h), s, c in
                itertools.product(CASES, ("none", "gds", "compat"), CLIP)]
    command = " ".join(["python bench/plan_time.py"] + argv)
    rows += [dict(cli(a), command=command) for a in STATES_ON_DRIVE]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(command="python bench/plan_time.py", machine=platform.processor()
                                   or platform.machine(), cores=os.cpu_count(),
                                   rows=rows), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
