"""Mutation check of the planner's evidence: break one cost-model term, the search's pruning
or its feasibility test at a time, run the tests that should notice, and report which did.

Each mutation is a literal text replacement in one or more source files, applied to a fresh
copy of this checkout (tracked and untracked files; the checkout itself is never touched).
A mutation is *caught* when at least one of its real-plan tests fails: tests that run a plan
through the runtime (checkpoint / swap / NVMe hooks) and compare what it measures with the
prediction, or run the search's choice under the budget it was made for. Reference tests
(the pruned search against exhaustive enumeration, the runtime model's hand cases) run too and
are reported beside.

    python bench/mutations.py                 # every mutation; writes bench/results/mutations.json
    python bench/mutations.py --list          # what each mutation changes
    python bench/mutations.py --only bump     # one (or a comma-separated few)
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Tests that run a real plan: the runtime executes it (real checkpoint, swap and NVMe hooks)
# and what it measures is compared with the prediction, or the search's choice is run under
# the budget it was made for.
REAL_MEMORY = ("tests/test_block_shapes.py::test_predicted_activation_peak_is_what_the_runtime_counts",
               "tests/test_profiler.py::test_memory_model_rebuilds_the_measured_peak")
REAL_SEARCH = ("tests/test_block_shapes.py::test_search_under_a_tight_budget_picks_a_plan_that_really_fits",
               "tests/test_block_shapes.py::test_search_on_a_measured_profile_equals_brute_force_and_the_plan_runs")
# The pruned search against exhaustive enumeration on analytic profiles (no plan is run).
SEARCH = ("tests/test_search.py::test_search_equals_brute_force_when_memory_decides",
          "tests/test_search.py::test_budgets_just_above_and_below_a_plans_need",
          "tests/test_search.py::test_search_past_the_first_batch_equals_evaluating_every_candidate")


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    edits: tuple[tuple[str, str, str], ...]
    """(file, text to find - exactly once -, replacement)."""
    real: tuple[str, ...]
    """Tests that run a real plan; the mutation counts as caught when one of them fails."""
    reference: tuple[str, ...] = ()
    """Further tests that should catch it (run too, reported beside)."""


MUTATIONS = (
    Mutation("chain", "drop the checkpoint chain: a CKPT block frees its input too",
             (("protrain/cost/memory.py", "freed = np.where(m == CKPT, own - held, 0)",
               "freed = np.where(m == CKPT, own, 0)"),),
             REAL_MEMORY),
    Mutation("bump", "drop the recompute bump: a CKPT block's backward is its plain backward",
             (("protrain/cost/memory.py", "np.where(rec, np.maximum(recompute, bwd_keep), bwd_keep)",
               "bwd_keep"),),
             REAL_MEMORY),
    Mutation("in_flight", "drop the swap in flight: no offloaded block's copies on the device "
             "while it is written out or prefetched",
             (("protrain/cost/memory.py", "fwd = fp - x + prev_swapped", "fwd = fp - x"),
              ("protrain/cost/memory.py", "bwd_keep) + prev_swapped + twice", "bwd_keep) + twice")),
             REAL_MEMORY),
    Mutation("kept", "count storages a later part saves too as freed (the ReLU-tail bug)",
             (("protrain/cost/memory.py", "    own = saved - kept\n", "    own = saved\n"),),
             REAL_MEMORY),
    Mutation("recompute_time", "drop recompute time: a CKPT block's backward costs no forward",
             (("protrain/cost/time_backward.py",
               "redo = np.where(m == CKPT, part.fwd_time, np.where(m == SEL, part.sel_recompute_time, 0.0))",
               "redo = np.where(m == SEL, part.sel_recompute_time, 0.0)"),),
             ("tests/test_block_shapes.py::test_predicted_recompute_time_is_the_recompute_the_runtime_runs",),
             ("tests/test_runtime_model.py",)),
    Mutation("swap_host", "drop the host bytes of swapped activations from the host total",
             (("protrain/cost/memory.py",
               "host = int(model_state_host_bytes(layout, n_persist, sb, world)) + swap",
               "host = int(model_state_host_bytes(layout, n_persist, sb, world))"),
              ("protrain/search/space.py", "host = host_state[np_idx] + acts.swap_host[a_idx]",
               "host = host_state[np_idx]")),
             REAL_SEARCH, SEARCH),
    Mutation("first_batch", "stop after the first batch of lower-bound-ordered candidates",
             (("protrain/search/loop.py", "                st.best = min(st.best, st.times[sel].min())\n\n",
               "                st.best = min(st.best, st.times[sel].min())\n        break\n\n"),),
             REAL_SEARCH[1:], SEARCH),
    Mutation("infeasible", "accept infeasible peaks: every point passes the device budget",
             (("protrain/search/space.py", "dev_ok = (peak <= budget) & (nb >= nbmin)",
               "dev_ok = (nb >= nbmin)"),),
             REAL_SEARCH, SEARCH),
    Mutation("margin", "ignore the fragmentation margin in the search's device budget",
             (("protrain/search/loop.py", "budget = hw.device_memory / (1.0 + config.memory_margin)",
               "budget = hw.device_memory"),),
             REAL_SEARCH, SEARCH),
)


def copy_checkout(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def apply(tree: Path, m: Mutation) -> None:
    for rel, old, new in m.edits:
        path = tree / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"mutation {m.name}: {rel} holds {text.count(old)} copies of {old!r}, "
                             f"not exactly one; update bench/mutations.py to the code")
        path.write_text(text.replace(old, new))


def run_tests(tree: Path, tests, timeout: float) -> tuple[bool, str, float]:
    """(caught, first failing test or '', seconds)."""
    env = dict(__import__("os").environ, PYTHONPATH=str(tree))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", *tests],
                       cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    failed = [ln.split(" ", 1)[1].split(" - ")[0] for ln in r.stdout.splitlines() if ln.startswith("FAILED ")]
    if r.returncode not in (0, 1):
        raise SystemExit(f"pytest exited {r.returncode} (not a test failure):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r.returncode == 1, failed[0] if failed else "", time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the mutations and exit")
    ap.add_argument("--only", default="", help="comma-separated mutation names")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per mutation's test run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "mutations.json"))
    a = ap.parse_args()
    chosen = [m for m in MUTATIONS if not a.only or m.name in a.only.split(",")]
    if a.list:
        for m in MUTATIONS:
            print(f"{m.name:<15} {m.what}")
            for rel, old, new in m.edits:
                print(f"{'':<15}   {rel}: {old.strip()!r} -> {new.strip()!r}")
        return
    unknown = set(filter(None, a.only.split(","))) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"--only: unknown mutation(s) {sorted(unknown)}; see --list")
    rows = []
    with tempfile.TemporaryDirectory(prefix="protrain-mutants-") as tmp:
        clean = Path(tmp) / "clean"
        copy_checkout(clean)
        every = sorted({t for m in chosen for t in m.real + m.reference})
        caught, first, seconds = run_tests(clean, every, a.timeout)
        if caught:
            raise SystemExit(f"the unmutated checkout fails {first}: fix that first")
        print(f"unmutated: the {len(every)} test selections pass ({seconds:.0f} s)")
        for m in chosen:
            tree = Path(tmp) / m.name
            shutil.copytree(clean, tree)
            apply(tree, m)
            caught, first, seconds = run_tests(tree, m.real, a.timeout)
            row = dict(mutation=m.name, what=m.what, caught=caught, caught_by_real_plan=first,
                       seconds=round(seconds, 1), real_plan_tests=list(m.real))
            if m.reference:
                ref_caught, ref_first, ref_s = run_tests(tree, m.reference, a.timeout)
                row.update(reference_tests=list(m.reference), reference_caught=ref_caught,
                           caught_by_reference=ref_first)
                seconds += ref_s
            rows.append(row)
            ref = (f"; reference: {row['caught_by_reference'] or 'not caught'}" if m.reference else "")
            print(f"{m.name:<15} {'caught' if caught else 'MISSED':<7} {first or '-'}{ref}  ({seconds:.0f} s)",
                  flush=True)
            shutil.rmtree(tree)
    missed = [r["mutation"] for r in rows if not r["caught"]]
    record = dict(command="python bench/mutations.py" + (f" --only {a.only}" if a.only else ""),
                  results=rows, missed=missed)
    if not a.only:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {a.out}")
    print("every mutation caught" if not missed else f"MISSED: {', '.join(missed)}")
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
