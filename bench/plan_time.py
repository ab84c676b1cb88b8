"""Planning time of the search on analytic profiles (CPU; planning never needs a GPU).

    python bench/plan_time.py                   # every case
    python bench/plan_time.py --states-on-drive # only the case of issue 27 (its row updated)

Each model is planned for an H100 80 GB without an SSD tier, and with a 12 GB/s NVMe drive
under GPUDirect Storage and in compatibility mode (the SSD mode multiplies the candidates);
with gradient clipping off (CPU Adam overlaps backward) and on (DeepSpeed's default and
``protrain plan``'s: CPU Adam waits for the verdict, the search also picks how many chunks
speculate), and for llama2-13b also with 256 GiB of host memory (tens of thousands of plans
within a few per cent, bound by CPU Adam). And issue 27's case: llama2-70b at sequence 4096
with clipping, 256 GiB of host memory (its states need 854 GiB) and a 12 GB/s drive with 4 TiB
free in compatibility mode - the search puts most chunks' optimizer states on the drive
(n_nvme). Writes bench/results/plan_time.json: for each case the blocks, the feasible
candidates, how many the search simulated, and the best of 3 wall times of ``search``.
"""
from __future__ import annotations

import itertools
import json
import platform
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


STATES_ON_DRIVE = ("llama2-70b", 1, 256, 4096, "compat", "on", 4 * 2**40)
"""Issue 27's case: (model, micro-batch, host GiB, sequence, drive mode, clipping, drive free)."""


def _row(name: str, mb: int, host_gib: int, ssd: str, clip: str, seq: int | None = None,
         free: int = 2**40) -> dict:
    hw = machine("h100-80gb").profile(host_memory=host_gib * GiB)
    if ssd != "none":
        hw = replace(hw, nvme_write_bandwidth=12e9, nvme_read_bandwidth=12e9,
                     nvme_gds=ssd == "gds", nvme_free_bytes=free)
    shape = replace(PRESETS[name], micro_batch=mb, seq_len=seq or PRESETS[name].seq_len)
    prof = analytic_profile(shape, hw)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        plan = search(prof, hw, CLIP[clip])
        best = min(best, time.perf_counter() - t0)
    print(f"{name:<11} host {host_gib:>4} GiB ssd {ssd:<6} clip {clip:<3} {prof.n_blocks:>3} blocks  "
          f"{plan.candidates_total:>7} feasible  {plan.candidates_evaluated:>6} simulated  {best * 1e3:7.1f} ms"
          + (f"  n_nvme {plan.knobs.n_nvme}" if plan.knobs.n_nvme else ""))
    return dict(model=name, ssd=ssd, clip=clip, blocks=prof.n_blocks, micro_batch=mb, host_gib=host_gib,
                seq=shape.seq_len, candidates=plan.candidates_total, simulated=plan.candidates_evaluated,
                seconds=best, knobs=plan.knobs.as_tuple(), n_speculate=plan.n_speculate,
                n_nvme=plan.knobs.n_nvme, host_bytes=plan.prediction.host_bytes,
                step_time=plan.prediction.step_time)


def main() -> None:
    out = Path(__file__).parent / "results" / "plan_time.json"
    name, mb, host_gib, seq, ssd, clip, free = STATES_ON_DRIVE
    if "--states-on-drive" in sys.argv[1:]:        # that row alone, the others kept as measured
        rows = [r for r in json.loads(out.read_text())["rows"] if r.get("seq") != seq or r["model"] != name]
        rows.append(_row(name, mb, host_gib, ssd, clip, seq, free))
    else:
        rows = [_row(n, m, h, s, c) for (n, m, h), s, c in
                itertools.product(CASES, ("none", "gds", "compat"), CLIP)]
        rows.append(_row(name, mb, host_gib, ssd, clip, seq, free))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(command="python bench/plan_time.py", machine=platform.processor()
                                   or platform.machine(), cores=__import__("os").cpu_count(),
                                   rows=rows), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
