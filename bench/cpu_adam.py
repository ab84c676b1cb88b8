"""CPU Adam kernels side by side: parameters/s, and how far a Python thread gets meanwhile.

The question behind it: CPU Adam runs on a worker thread while the training thread keeps
going (backward hooks, the next forward's first parts). A kernel that holds the GIL stalls
that thread for the whole update. For each kernel, in one run on the same tensors:

- ``Gparam/s``: parameters updated per second on the worker thread while the main thread
  spins in Python (the situation during training), median of ``--repeat`` updates;
- ``progress``: the main thread's spin iterations during the update, as a fraction of its
  free rate (measured alone just before);
- for 16-bit training and for a speculative (backed-up) update, the fused native pass
  against the unfused Python sequence it replaces (what the chunk path did before).

    python bench/cpu_adam.py                       # 20 M fp32 parameters
    python bench/cpu_adam.py --numel 50e6 --threads 1 --save bench/results/cpu_adam-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def spin_rate(seconds: float = 0.3) -> float:
    """Python loop iterations per second on this thread, nothing else running: the same loop
    as the one measured beside an update (``on_worker``), stopped by a timer."""
    done = threading.Event()
    timer = threading.Timer(seconds, done.set)
    n, start = 0, time.perf_counter()
    timer.start()
    while not done.is_set():
        n += 1
    return n / (time.perf_counter() - start)


def on_worker(fn) -> tuple[float, int]:
    """Run ``fn`` on a thread while this one spins; (seconds fn took, spin iterations)."""
    done = threading.Event()
    took = [0.0]

    def work():
        t = time.perf_counter()
        fn()
        took[0] = time.perf_counter() - t
        done.set()

    th = threading.Thread(target=work)
    n = 0
    start = time.perf_counter()
    th.start()
    while not done.is_set():
        n += 1
    wall = time.perf_counter() - start
    th.join()
    return took[0], n / wall * took[0] if wall > 0 else 0


def alone(fn, repeat) -> float:
    """Median seconds of ``fn`` on this thread, nothing else running."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(name, fn, numel, repeat):
    """Throughput alone; then on a worker while this thread spins: the worker's throughput and
    the spinning thread's progress against its free rate, measured just before (after a pause:
    OpenMP's worker threads spin for a while after a parallel region and would depress it)."""
    t_alone = alone(fn, repeat)
    time.sleep(0.5)
    free = max(spin_rate() for _ in range(3))     # the best of three: the machine is shared
    runs = [on_worker(fn) for _ in range(repeat)]
    t = statistics.median(r[0] for r in runs)
    progress = statistics.median(r[1] / (free * r[0]) for r in runs if r[0] > 0)
    row = {"kernel": name, "seconds_alone": t_alone, "gparam_per_s_alone": numel / t_alone / 1e9,
           "seconds": t, "gparam_per_s": numel / t / 1e9, "progress": progress, "free_spin_rate": free}
    print(f"{name:34s} alone {row['gparam_per_s_alone']:6.3f} Gparam/s | beside a spinning thread "
          f"{row['gparam_per_s']:6.3f} Gparam/s, its progress {progress:5.1%}", flush=True)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=float, default=20e6)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="OpenMP threads for the native kernel (default: cores - 1, one core "
                         "left to the training thread)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--save", default=None)
    args = ap.parse_args(argv)
    n = int(args.numel)

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

    print(f"{n / 1e6:.0f} M parameters, native kernel on {args.threads} thread(s); torch and "
          f"DeepSpeed's kernel use {torch.get_num_threads()}", flush=True)
    rows = [measure("DeepSpeedCPUAdam (GIL held)", ds_update, n, args.repeat),
            measure("torch _fused_adamw_ (GIL free)", torch_fused, n, args.repeat),
            measure("protrain native (GIL free)", nat_update, n, args.repeat),
            measure("bf16 chain: DeepSpeed + torch ops", ds_bf16_chain, n, args.repeat),
            measure("bf16 chain: native fused",
                    lambda: nat_update(g16, 0.5, copy=shadow), n, args.repeat),
            measure("backup + update: torch copy + DS", ds_backup_chain, n, args.repeat),
            measure("backup + update: native fused", lambda: nat_update(bk=backup), n,
                    args.repeat)]
    result = {"command": "python bench/cpu_adam.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "numel": n, "native_threads": args.threads, "rows": rows}
    if args.save:
        Path(args.save).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
