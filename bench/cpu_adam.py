"""CPU Adam kernels side by side: parameters/s, and how far a Python thread gets meanwhile.

The question behind it: CPU Adam runs on a worker thread while the training thread keeps
going (backward hooks, the next forward's first parts). A kernel that holds the GIL stalls
that thread for the whole update. For each kernel, on the same tensors:

- ``Gparam/s alone``: parameters updated per second, the kernel on this thread, nothing else;
- ``Gparam/s beside``: the same on a persistent worker thread (as in training) while this
  thread spins in a Python loop; it includes the GIL hand-offs such a thread pays (a thread
  waiting for the GIL gets it from a spinning one after ``sys.getswitchinterval()``, 5 ms);
- ``progress``: the spinning thread's loop rate during that update, as a fraction of its free
  rate; the free rate is measured right before each such update, with the identical loop
  beside the same worker, which sleeps (GIL released) for as long as the kernel took alone --
  so the same loop, thread set-up and GIL hand-offs, only without the kernel's work;
- for 16-bit training and for a speculative (backed-up) update, the fused native pass
  against the unfused Python sequence it replaces (what the chunk path did before).

How, on a machine that may be shared and noisy: all kernels use ``--threads`` OpenMP threads
(native as its argument; torch's and DeepSpeed's kernels read it from the calling thread, set
with ``torch.set_num_threads`` on this thread and on the worker); each is warmed up; then
``--repeat`` rounds, each running every kernel once alone and once beside, in a fresh random
order (interleaved: drift of the machine reaches all kernels alike). Reported are medians over
the rounds and, for the pairs compared (native and torch against DeepSpeed, each fused pass
against its unfused sequence), ``speedup``: the median over rounds of that round's time ratio.
On Linux the CPU time that other processes used during a round is read from /proc/stat (the
machine's busy time less this process's own); a round in which they used more than
``--max-other`` cores is discarded and run again (at most ``--repeat`` extra rounds; the count
is saved).

    python bench/cpu_adam.py                       # 20 M fp32 parameters, all cores
    python bench/cpu_adam.py --numel 20e6 --threads 2 --repeat 31 --save bench/results/cpu_adam-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# protrain-autoload.pth imports protrain at interpreter start from wherever it is installed;
# measure this checkout's (its native kernel is built from its csrc/).
for _name in [k for k in sys.modules if k == "protrain" or k.startswith("protrain.")]:
    if not str(getattr(sys.modules[_name], "__file__", "") or "").startswith(str(ROOT)):
        del sys.modules[_name]


class Worker(threading.Thread):
    """One persistent thread that runs what it is given, as the training's CPU Adam worker."""

    def __init__(self, threads: int):
        super().__init__(daemon=True)
        self.threads = threads
        self.go, self.done = threading.Event(), threading.Event()
        self.fn, self.took = None, 0.0
        self.start()

    def run(self):
        torch.set_num_threads(self.threads)     # this thread's OpenMP threads (DeepSpeed, torch)
        while True:
            self.go.wait()
            self.go.clear()
            t = time.perf_counter()
            self.fn()
            self.took = time.perf_counter() - t
            self.done.set()

    def beside(self, fn) -> tuple[float, float]:
        """Run ``fn`` on the worker while this thread spins: (seconds fn took there, this
        thread's loop iterations per second meanwhile)."""
        self.fn = fn
        self.done.clear()
        n = 0
        start = time.perf_counter()
        self.go.set()
        while not self.done.is_set():
            n += 1
        return self.took, n / (time.perf_counter() - start)


class OtherLoad:
    """CPU time (in cores) other processes used between ``start`` and ``stop`` (Linux
    /proc/stat: the machine's busy time less this process's); None where unavailable."""

    def __init__(self):
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _busy(self):
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        return (sum(v) - v[3] - v[4]) / self.tick     # all but idle and iowait, seconds

    def start(self):
        t = os.times()
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy(), t.user + t.system

    def stop(self):
        busy = self._busy()
        if busy is None or self.busy0 is None:
            return None
        t = os.times()
        own = t.user + t.system - self.own0
        return max(0.0, busy - self.busy0 - own) / (time.perf_counter() - self.t0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=float, default=20e6)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="OpenMP threads for every kernel (default: torch's, all cores)")
    ap.add_argument("--repeat", type=int, default=15, help="interleaved rounds")
    ap.add_argument("--max-other", type=float, default=0.25,
                    help="redo a round in which other processes used more cores than this")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round kernel order")
    ap.add_argument("--save", default=None)
    args = ap.parse_args(argv)
    n = int(args.numel)
    torch.set_num_threads(args.threads)

    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from protrain import native
    nat = native.cpu_adam()
    nat.create(1, True)
    ds = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], adamw_mode=True)
    h = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01)
    torch.manual_seed(0)
    p, g = torch.randn(n), torch.randn(n) * 1e-3
    m, v = torch.zeros(n), torch.zeros(n)
    g16, shadow = g.to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    backup = [torch.empty(n), torch.empty(n), torch.empty(n)]
    step = [0]

    def ds_update(grads=g):
        step[0] += 1
        ds.ds_opt_adam.adam_update(ds.opt_id, step[0], h["lr"], h["b1"], h["b2"], h["eps"], h["wd"],
                                   True, p, grads, m, v)

    def nat_update(grads=g, scale=1.0, bk=(), copy=None):
        step[0] += 1
        nat.update(1, step[0], h["lr"], h["b1"], h["b2"], h["eps"], h["wd"], True, p, grads, m, v,
                   scale, list(bk), copy, args.threads)

    def torch_fused():
        step[0] += 1
        torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(float(step[0]))], lr=h["lr"],
                            beta1=h["b1"], beta2=h["b2"], weight_decay=h["wd"], eps=h["eps"],
                            amsgrad=False, maximize=False)

    def ds_bf16_chain():   # the chunk path before: widen + scale, update, write the upload copy
        gf = g16.float().mul_(torch.tensor([0.5]))
        ds_update(gf)
        shadow.copy_(p)

    def ds_backup_chain():  # back up the states, then update
        for dst, src in zip(backup, (p, m, v)):
            dst.copy_(src)
        ds_update()

    DS, DS16, DSBK = ("DeepSpeedCPUAdam (GIL held)", "bf16 chain: DeepSpeed + torch ops",
                      "backup + update: torch copy + DS")
    kernels = {   # name: (function, the kernel it is compared with)
        DS: (ds_update, None),
        "torch _fused_adamw_ (GIL free)": (torch_fused, DS),
        "protrain native (GIL free)": (nat_update, DS),
        DS16: (ds_bf16_chain, None),
        "bf16 chain: native fused": (lambda: nat_update(g16, 0.5, copy=shadow), DS16),
        DSBK: (ds_backup_chain, None),
        "backup + update: native fused": (lambda: nat_update(bk=backup), DSBK),
    }
    print(f"{n / 1e6:.0f} M parameters, {args.threads} OpenMP thread(s) for every kernel, "
          f"{args.repeat} interleaved rounds", flush=True)
    worker = Worker(args.threads)
    for fn, _ in kernels.values():     # warm up: first calls, the worker's OpenMP team
        fn()
        fn()
        worker.beside(fn)

    names = list(kernels)
    rounds = {k: {"alone": [], "beside": [], "progress": [], "free": []} for k in names}
    order_rng = random.Random(args.seed)
    load, redone, done = OtherLoad(), 0, 0
    while done < args.repeat:
        order = names[:]
        order_rng.shuffle(order)
        load.start()
        got = {}
        for k in order:
            fn = kernels[k][0]
            t = time.perf_counter()
            fn()
            alone = time.perf_counter() - t
            _, free = worker.beside(lambda: time.sleep(alone))
            took, rate = worker.beside(fn)
            got[k] = (alone, took, rate / free, free)
        other = load.stop()
        if other is not None and other > args.max_other and redone < args.repeat:
            redone += 1
            continue
        done += 1
        for k, (alone, took, prog, free) in got.items():
            r = rounds[k]
            r["alone"].append(alone)
            r["beside"].append(took)
            r["progress"].append(prog)
            r["free"].append(free)

    med = statistics.median
    rows = []
    for k in names:
        r, ref = rounds[k], kernels[k][1]
        row = {"kernel": k, "seconds_alone": med(r["alone"]),
               "gparam_per_s_alone": n / med(r["alone"]) / 1e9,
               "seconds": med(r["beside"]), "gparam_per_s": n / med(r["beside"]) / 1e9,
               "progress": med(r["progress"]), "free_spin_rate": med(r["free"]),
               "free_spin_rate_range": [min(r["free"]), max(r["free"])]}
        line = (f"{k:34s} alone {row['gparam_per_s_alone']:6.3f} Gparam/s | beside a spinning thread "
                f"{row['gparam_per_s']:6.3f} Gparam/s, its progress {row['progress']:6.1%}")
        if ref is not None:
            q = rounds[ref]
            row["compared_with"] = ref
            row["speedup_alone"] = med(a / b for a, b in zip(q["alone"], r["alone"]))
            row["speedup_beside"] = med(a / b for a, b in zip(q["beside"], r["beside"]))
            line += (f" | vs {'DeepSpeed' if ref == DS else 'unfused'}: alone "
                     f"{row['speedup_alone'] - 1:+.1%}, beside {row['speedup_beside'] - 1:+.1%}")
        print(line, flush=True)
        rows.append(row)
    if redone:
        print(f"{redone} round(s) run again: other processes were busy", flush=True)
    result = {"command": "python bench/cpu_adam.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "native_module": nat.__file__, "numel": n, "threads": args.threads, "rounds": args.repeat, "rounds_redone": redone,
              "max_other_cores": args.max_other, "gil_switch_interval_s": sys.getswitchinterval(),
              "rows": rows}
    if args.save:
        Path(args.save).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
