"""Optimizer states on a drive: ProTrain's ``n_nvme`` against DeepSpeed's ZeRO-Infinity.

One model, the same data and the same directory, each system in its own process, the systems
interleaved in ``--rounds`` rounds (bench/ds_compare.py's harness); fp32, AdamW, clipping at 1.0:

- zinf: DeepSpeed ZeRO-3 with ``offload_optimizer: {"device": "nvme"}`` (ZeRO-Infinity's fp32
  master, exp_avg and exp_avg_sq in swap files under the directory, through DeepSpeed's
  libaio op with O_DIRECT) and ``offload_param: {"device": "cpu"}`` (the parameters in host
  memory, as ours stay: ZeRO-Infinity's docs put parameters on the drive only when host
  memory cannot hold them); the buffer and aio values of DeepSpeed's NVMe example, with
  ``pipeline_read`` / ``pipeline_write`` on (the next sub-group read and the last written
  while one updates, as ours) and ``sub_group_size`` set to ProTrain's chunk (DeepSpeed's
  1e9 default makes this model one sub-group, staged whole in pinned host buffers) and
  ``buffer_count`` 12 (pipelining holds three sub-groups of four tensors: master, exp_avg,
  exp_avg_sq, gradient; fewer stops it with "ran out of swap buffers");
- nvme: ProTrain with every chunk but one offloaded and the states of all offloaded chunks on
  the drive (``n_persist`` 1, ``n_nvme`` pinned to the offloaded count);
- nvme_noverify: nvme with ``ssd_verify: false`` - no checksums of the states read back (the
  default, "auto", checks every read against the CRC32s taken at the write): the cost of the
  checks, in the same run;
- nvme_plan: ProTrain with ``n_nvme`` left to the planner under a ``host_memory`` budget
  ``--host-fraction`` of the way from what nvme's plan needs in host memory to what host's
  needs (below what the states need there; the planner chooses how many go to the drive);
- host: ProTrain with the same chunks and every offloaded chunk's states in host memory (the
  reference; it runs first in every round, and its plan gives the chunk count nvme pins).

For each: tokens/s (each round's median step; the median over rounds), host bytes (the
process's resident set at the start of ``deepspeed.initialize``, its peak over the warm-up
and its peak over the timed steps, from VmHWM reset at each, and at the end; ProTrain's
``protrain_stats()`` host_state_bytes and nvme_state_bytes; DeepSpeed's pinned swap buffers,
the only host memory its NVMe offload reports), drive bytes (the largest allocated size of
the system's directory sampled after every step, and the storage bytes the process read and
wrote per timed step from /proc/self/io), and for ProTrain the plan's predicted step against
the measured median (also weighted by the fraction of steps that clipped, which run the
speculation's rollback). Results go to bench/results/nvme_states-<device>-<tag>.json.

DeepSpeed's async I/O op needs libaio: ``apt-get install -y libaio-dev`` (Debian/Ubuntu);
DeepSpeed then builds it on first use into ~/.cache/torch_extensions.

    OMP_NUM_THREADS=1 python bench/nvme_states.py --dir /path/on/drive --rounds 3 --steps 6
                                        # CPU, 26M GPT; one thread: a shared VM's load stalls two
    python bench/nvme_states.py --smoke --dir /tmp                        # CPU check
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from protrain.units import parse_bytes  # noqa: E402
from ds_compare import default_tag, parse, run_systems, shape_args, shape_spec, write_record  # noqa: E402

SYSTEMS = ("host", "nvme", "nvme_noverify", "nvme_plan", "zinf")
CLIP = 1.0
LIBAIO_HINT = ("DeepSpeed's async_io op (ZeRO-Infinity's NVMe offload) did not build: it needs "
               "libaio. Install it with `apt-get install -y libaio-dev` (Debian/Ubuntu; "
               "`dnf install libaio-devel` on Fedora) and run again; the op is built on first use "
               "into ~/.cache/torch_extensions")


def require_async_io() -> str:
    """Build (or load from the cache) DeepSpeed's async_io op; exit with the libaio hint if not."""
    from deepspeed.ops.op_builder import AsyncIOBuilder
    try:
        if not AsyncIOBuilder().is_compatible(verbose=False):
            raise RuntimeError("AsyncIOBuilder().is_compatible() is False")
        return AsyncIOBuilder().load(verbose=False).__file__
    except Exception as e:                      # a build error is any exception type
        raise SystemExit(f"{LIBAIO_HINT} ({type(e).__name__}: {e})") from e


def _proc_kib(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _proc_io() -> dict[str, int]:
    """The process's storage bytes (read_bytes, write_bytes: what reached the block layer)."""
    pairs = (ln.split(": ") for ln in Path("/proc/self/io").read_text().splitlines())
    return {k: int(v) for k, v in pairs}


def _reset_peak() -> None:
    """Reset VmHWM to the current resident set ("5" to clear_refs, Linux 4.0+)."""
    Path("/proc/self/clear_refs").write_text("5")


def dir_bytes(root: str) -> int:
    """Bytes allocated on the drive by the files under ``root`` (st_blocks: sparse files count
    what they hold)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_blocks * 512
            except FileNotFoundError:           # a scratch file removed while we walk
                pass
    return total


class HostDriveMeter:
    """Host and drive bytes of one system's run (bench/ds_compare.py's ``worker`` meter)."""

    def __init__(self, spec: dict):
        self.dir, self.warmup, self.steps = spec["drive_dir"], spec["warmup"], spec["steps"]
        self.peak_dir = 0
        self.io: dict[str, dict[str, int]] = {}
        self.norms: list[float] = []

    def start(self) -> None:
        _reset_peak()
        self.rss_start = _proc_kib("VmRSS")

    def step(self, engine, step: int) -> None:
        self.peak_dir = max(self.peak_dir, dir_bytes(self.dir))
        if step == self.warmup - 1:
            # The warm-up's peak includes start-up transients (ProTrain's drive probe writes
            # 256 MiB from a host buffer); the timed steps' peak is training's own.
            self.rss_warmup_peak = _proc_kib("VmHWM")
            _reset_peak()
            self.io["start"] = _proc_io()
        if step == self.warmup + self.steps - 1:
            self.io["end"] = _proc_io()
        if step >= self.warmup:
            self.norms.append(_grad_norm(engine))

    def finish(self, engine, out: dict) -> None:
        io = {k: (self.io["end"][k] - self.io["start"][k]) / self.steps for k in ("read_bytes", "write_bytes")}
        out.update(rss_start=self.rss_start, rss_warmup_peak=self.rss_warmup_peak,
                   rss_peak=_proc_kib("VmHWM"), rss_end=_proc_kib("VmRSS"),
                   drive_dir_peak_bytes=self.peak_dir, drive_dir_end_bytes=dir_bytes(self.dir),
                   drive_read_bytes_per_step=io["read_bytes"], drive_write_bytes_per_step=io["write_bytes"],
                   grad_norms=self.norms, clip_fraction=sum(n > CLIP for n in self.norms) / len(self.norms))
        out["rss_growth_peak"] = out["rss_peak"] - self.rss_start
        if getattr(engine, "protrain_runtime", None) is not None:
            _protrain_side(engine, out)
        else:
            out["ds_swap_buffer_bytes"] = _ds_swap_buffer_bytes(engine)


def _grad_norm(engine) -> float:
    rt = getattr(engine, "protrain_runtime", None)
    norm = rt.optimizer.global_grad_norm if rt is not None else engine.get_global_grad_norm()
    return float(norm)


def _protrain_side(engine, out: dict) -> None:
    """The plan's predictions and the runtime's own count of where the states are."""
    plan = engine.protrain_plan
    p = plan.prediction
    stats = engine.protrain_stats()
    out.update(protrain_stats=stats, n_chunks=plan.chunks.n_chunks, n_nvme=plan.knobs.n_nvme,
               n_persist=plan.knobs.n_persist, predicted_host_bytes=p.host_bytes,
               predicted_ssd_bytes=p.ssd_bytes, predicted_step_time=p.step_time,
               predicted_expected=p.expected_iter_time(out["clip_fraction"]))
    out["step_ratio"] = p.step_time / out["step_time_median"]
    out["expected_step_ratio"] = out["predicted_expected"] / out["step_time_median"]
    nvme = getattr(engine.protrain_runtime.chunks, "nvme", None)
    if nvme is not None:
        out.update(nvme_backend=nvme.backend, nvme_read_bytes=nvme.read_bytes,
                   nvme_written_bytes=nvme.written_bytes)


def _ds_swap_buffer_bytes(engine) -> int | None:
    """DeepSpeed's page-locked swap buffers for the optimizer states (its NVMe staging)."""
    swapper = getattr(engine.optimizer, "optimizer_swapper", None)
    mgr = getattr(swapper, "swap_buffer_manager", None)
    if mgr is None:
        return None
    return sum(b.numel() * b.element_size() for b in mgr.all_buffers)


def configs(system: str, drive: str, n_chunks: int | None, host_budget: int | None, chunk: str) -> dict:
    """The DeepSpeed config section of one system; ``drive`` is its own directory."""
    if system == "zinf":
        return {"zero_optimization": {
            "stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "nvme", "nvme_path": drive, "pin_memory": True,
                                  "buffer_count": 12, "fast_init": False,
                                  "pipeline_read": True, "pipeline_write": True},
            "sub_group_size": parse_bytes(chunk) // 4},          # fp32 elements of one chunk
            "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1,
                    "single_submit": False, "overlap_events": True}}
    pt = {"enabled": True, "progress": False, "chunk_size": chunk, "n_persist": 1}
    if system in ("nvme", "nvme_noverify"):
        pt.update(ssd_path=drive, n_nvme=n_chunks - 1)
        if system == "nvme_noverify":
            pt.update(ssd_verify=False)
    elif system == "nvme_plan":
        pt.update(ssd_path=drive, host_memory=host_budget)
    return {"protrain": pt}


def ordered(wanted: list[str]) -> list[str]:
    """The host reference first, then nvme: the others take their chunk count and host bytes."""
    return sorted(wanted, key=lambda s: (s != "host", s != "nvme"))


def host_budget(refs: dict[str, dict], fraction: float) -> int:
    """nvme_plan's host_memory: ``fraction`` of the way from what the plan with every offloaded
    chunk's states on the drive needs in host memory to what the host reference needs - below
    the states' need, above the least the drive leaves (parameters, gradients, staging ring)."""
    least, most = refs["nvme"]["predicted_host_bytes"], refs["host"]["predicted_host_bytes"]
    return int(least + fraction * (most - least))


def run_round(args, wanted: list[str], refs: dict[str, dict]) -> list[dict]:
    """One round, each system in its own emptied directory. ``refs``: the first successful host
    and nvme runs so far (updated here)."""
    shape = shape_spec(args)
    results = []
    for system in ordered(wanted):
        needs = {"nvme": ("host",), "nvme_noverify": ("host",),
                 "nvme_plan": ("host", "nvme")}.get(system, ())
        if any(n not in refs for n in needs):
            results.append(dict(system=system, error=f"needs successful {' and '.join(needs)} runs first"))
            continue
        drive = os.path.join(args.dir, f"nvme-bench-{system}")
        shutil.rmtree(drive, ignore_errors=True)
        os.makedirs(drive)
        budget = host_budget(refs, args.host_fraction) if system == "nvme_plan" else None
        n_chunks = refs["host"]["n_chunks"] if "host" in refs else None
        cfg = configs(system, drive, n_chunks, budget, args.chunk_size)
        r = run_systems([dict(system=system, config=cfg, drive_dir=drive, **shape)], script=__file__)[0]
        # What the process left in its directory after it exited (DeepSpeed keeps its swap files).
        r["drive_dir_after_exit_bytes"] = dir_bytes(drive)
        shutil.rmtree(drive, ignore_errors=True)
        if budget is not None:
            r["host_memory_budget"] = budget
        if system in ("host", "nvme") and "tokens_per_s" in r:
            refs.setdefault(system, r)
        results.append(r)
    return results


def summarize(rounds: list[list[dict]], wanted: list[str]) -> list[dict]:
    """Per system: the round with the median tokens/s, with every round's tokens/s beside."""
    out = []
    for system in ordered(wanted):
        runs = [r for rnd in rounds for r in rnd if r["system"] == system]
        good = sorted((r for r in runs if "tokens_per_s" in r), key=lambda r: r["tokens_per_s"])
        pick = good[(len(good) - 1) // 2] if good else runs[0]
        # The fastest step of all rounds: what the system does when the shared VM leaves it alone.
        best = min((t for r in good for t in r["step_times"]), default=None)
        out.append(dict(pick, rounds_tokens_per_s=[r.get("tokens_per_s") for r in runs], step_time_best=best,
                        tokens_per_s_median=statistics.median(r["tokens_per_s"] for r in good) if good else None))
    host = next((r for r in out if r["system"] == "host" and "losses" in r), None)
    for r in out:
        if host and "losses" in r and r["system"].startswith("nvme"):
            r["losses_equal_host"] = r["losses"] == host["losses"]
    return out


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def report(results: list[dict]) -> dict:
    """Print the table; the tokens/s ratios against ZeRO-Infinity and the host reference."""
    ok = {r["system"]: r for r in results if r.get("tokens_per_s_median")}
    ratios = {f"{s}/{ref}": ok[s]["tokens_per_s_median"] / ok[ref]["tokens_per_s_median"]
              for s in ok for ref in ("zinf", "host") if ref in ok and s != ref}
    if "nvme" in ok and "nvme_noverify" in ok:       # what the checksums cost
        ratios["nvme/nvme_noverify"] = ok["nvme"]["tokens_per_s_median"] / ok["nvme_noverify"]["tokens_per_s_median"]
    print(f"\n{'system':<14}{'tokens/s':>9}{'vs zinf':>8}{'RSS MiB start/+peak':>21}{'host st.':>9}"
          f"{'drive st.':>10}{'dir peak':>9}{'rd/wr MiB/step':>16}{'step s med/best':>16}{'pred/meas':>10}")
    for r in results:
        if not r.get("tokens_per_s_median"):
            print(f"{r['system']:<14}{'failed':>9}  {r.get('error', '')[-300:]}")
            continue
        st = r.get("protrain_stats") or {}
        vs = ratios.get(f"{r['system']}/zinf")
        pred = f"{r['step_ratio']:.2f}" if "step_ratio" in r else "-"
        print(f"{r['system']:<14}{r['tokens_per_s_median']:>9,.0f}{(f'{vs:.2f}x' if vs else '-'):>8}"
              f"{_mib(r['rss_start']) + '/+' + _mib(r['rss_growth_peak']):>21}"
              f"{_mib(st.get('host_state_bytes', r.get('ds_swap_buffer_bytes'))):>9}"
              f"{_mib(st.get('nvme_state_bytes')):>10}{_mib(r['drive_dir_peak_bytes']):>9}"
              f"{_mib(r['drive_read_bytes_per_step']) + '/' + _mib(r['drive_write_bytes_per_step']):>16}"
              f"{r['step_time_median']:>9.2f}/{r['step_time_best']:<6.2f}{pred:>10}")
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape_args(ap, layers=8, hidden=512, heads=8, vocab=1024, seq=256, micro_batch=4, steps=6, warmup=3, tie=0)
    ap.add_argument("--dir", help="directory on the drive both systems put states in (required)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk-size", default="8MiB", help="ProTrain's chunk size, pinned for all its systems")
    ap.add_argument("--host-fraction", type=float, default=0.5,
                    help="nvme_plan's host_memory: this fraction of the way from nvme's planned host "
                         "bytes to host's")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    args = parse(ap, meter=HostDriveMeter)
    if args is None:
        return
    if args.smoke:
        args.chunk_size = "64KiB"
    wanted = args.systems.split(",")
    unknown = set(wanted) - set(SYSTEMS)
    if unknown:
        ap.error(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if not 0 < args.host_fraction < 1:
        ap.error(f"--host-fraction {args.host_fraction}: a fraction between 0 and 1 (of the way from "
                 "nvme's planned host bytes to host's)")
    if not args.dir or not os.path.isdir(args.dir):
        ap.error(f"--dir {args.dir}: not a directory; give an existing directory on the drive to test")
    aio = require_async_io() if "zinf" in wanted else None
    rounds, refs, loads = [], {}, []
    for i in range(args.rounds):
        loads.append(os.getloadavg())
        print(f"-- round {i + 1}/{args.rounds}, load {loads[-1][0]:.2f}", flush=True)
        rounds.append(run_round(args, wanted, refs))
    results = summarize(rounds, wanted)
    ratios = report(results)
    if "nvme/nvme_noverify" in ratios:
        print(f"checksums of the states read back (ssd_verify auto vs false): "
              f"{ratios['nvme/nvme_noverify']:.3f}x the tokens/s")
    out = write_record("nvme_states", default_tag(args), args, results, ratios=ratios, dir=args.dir,
                       filesystem=_filesystem(args.dir), async_io=aio, chunk_size=args.chunk_size,
                       loads_before_rounds=loads, load_after=os.getloadavg(), rounds=rounds)
    print(f"wrote {out}")

def _filesystem(path: str) -> str:
    """The mount under ``path`` from /proc/mounts: device, type (what the 'drive' really is)."""
    best = ("", "?", "?")
    real = os.path.realpath(path)
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mnt, typ = line.split()[:3]
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
            best = (mnt, dev, typ)
    return f"{best[1]} ({best[2]}) mounted at {best[0]}"


if __name__ == "__main__":
    main()
