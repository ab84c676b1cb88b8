"""Measure this machine -> HardwareProfile. Rates are cached on disk keyed by hardware,
software, the threads measured with and the ranks per node; memory budgets are measured at
every call.

A few seconds of probes (plus a one-time build of DeepSpeedCPUAdam): pinned host<->device
bandwidth, the device's fused Adam and DeepSpeed's CPU Adam throughput - cached, as they are
properties of the machine. Device and host memory depend on the moment (other processes, what
this one already holds, the model that will be trained): measured every time, never cached.
On a CPU-only machine the "device" is the CPU (for tests): bandwidths are memcpy rates, device
Adam is the CPU Adam, and there is no copy engine.

Once per node: the ranks of a node share its cores and memory bus, so figures measured by all
of them at once would be contended, different on each rank and cached for later runs. The
first process of the node to take the cache entry's file lock (``fcntl.flock`` in the cache
directory) measures; the node's other ranks wait on the lock - asleep, using no core - and then
read what it wrote. The host rates are the node's: measured with all the cores the node's ranks
run on (``runtime.node.node_cores``), whatever OMP_NUM_THREADS the launcher set for the training
threads; the cost model gives each rank 1/ranks_per_node of them (``cost.host_share``). The
per-chunk update overhead is measured with the kernel as one rank runs it (its share of the
cores), so it depends on the ranks per node too: both are in the key.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from ..profile.hardware import HardwareProfile
from .update_overhead import measure_step_dispatch, measure_update_overhead

PROBE_VERSION = 8
"""Bump when the probe measures differently, so old cache entries are not reused."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("PROTRAIN_CACHE", Path.home() / ".cache" / "protrain"))


def _versions() -> dict[str, str]:
    v = {"torch": torch.__version__, "probe": str(PROBE_VERSION)}
    if torch.version.cuda:
        v["cuda"] = torch.version.cuda
    try:
        import deepspeed
        v["deepspeed"] = deepspeed.__version__
    except Exception:  # noqa: BLE001 - deepspeed is optional for the probe
        pass
    return v


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _host_memory() -> tuple[int, int]:
    """(total, available) host bytes."""
    try:
        import psutil
        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except ImportError:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total // 2


def cache_key(device: torch.device, threads: int | None = None, ranks_per_node: int = 1) -> str:
    """The cache entry of this machine and software, measured with ``threads`` host threads
    (default: the node's cores) for ``ranks_per_node`` ranks."""
    from ..runtime.node import node_cores
    total, _ = _host_memory()
    ident = {"cpu": _cpu_model(), "cores": os.cpu_count(), "host": total // 2**30,
             "versions": _versions(), "device": device.type,
             "threads": threads or node_cores(), "ranks_per_node": ranks_per_node}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        ident.update(gpu=props.name, gpu_mem=props.total_memory, cc=f"{props.major}.{props.minor}")
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def probe_hardware(device: torch.device | str | None = None, *, cache_dir: str | Path | None = None,
                   refresh: bool = False, size_mib: int = 256, adam_params: int = 2**24,
                   progress: bool = True, ranks_per_node: int = 1,
                   threads: int | None = None) -> HardwareProfile:
    """Measure (or load from the cache) the profile of ``device`` (default: the current CUDA
    device, else the CPU), once per node (see the module doc). ``size_mib`` and ``adam_params``
    size the probes; ``ranks_per_node``: ranks sharing this host (recorded in the profile, and
    the overhead probe runs the kernel with their share of the cores); ``threads``: the host
    threads to measure the node's rates with (default: every core the process may run on).
    ``refresh``: an entry written before this call is not reused (one written while this call
    waited for the lock is: the node's measurement of now)."""
    from ..runtime.node import NodeShare, node_cores
    device = torch.device(device) if device is not None else \
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if ranks_per_node < 1:
        raise ValueError(f"probe_hardware: ranks_per_node={ranks_per_node}; must be at least 1")
    threads = threads or node_cores()
    share = NodeShare(ranks_per_node=ranks_per_node, local_rank=0, cores=threads).threads
    name = f"hardware-{cache_key(device, threads, ranks_per_node)}-{size_mib}-{adam_params}.json"
    since = time.time()
    rates = None
    with _node_lock(Path(cache_dir) if cache_dir is not None else default_cache_dir(), name) as cache:
        path = cache / name
        if path.exists() and not (refresh and path.stat().st_mtime < since):
            try:
                rates = HardwareProfile.load(path)
            except (ValueError, KeyError, TypeError, json.JSONDecodeError):
                pass  # a stale or damaged entry: measure again
        if rates is None:
            rates = replace(_measure_rates(device, size_mib, adam_params, progress, threads, share),
                            ranks_per_node=ranks_per_node)
            try:
                rates.save(path)
            except OSError:
                pass  # a read-only home is no reason to fail; the next run measures again
    return replace(rates, device_memory=device_capacity(device), host_memory=_host_memory()[1])


@contextmanager
def _node_lock(cache: Path, name: str):
    """Hold the node's lock of the cache entry ``name`` (blocking until the process holding it
    has measured and written it); yields the directory to read and write the entry in: the
    cache directory, or where it cannot be written a directory in this node's temporary space
    (the node's ranks still measure once and share the result)."""
    fd = None
    for d in (cache, Path(tempfile.gettempdir()) / f"protrain-{os.getuid()}"):
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd = os.open(d / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o666)
            cache = d
            break
        except OSError:
            continue
    if fd is None:          # nowhere to lock: measure alone, as before
        yield cache
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield cache
    finally:
        os.close(fd)         # releases the lock


def device_capacity(device: torch.device) -> int:
    """Bytes of device memory this process can allocate now: what the device has free plus
    what torch's caching allocator already holds, allocated or only reserved (a profiling
    iteration's peak stays reserved after it; the model's own tensors are replaced by the
    plan's chunks). On a CPU "device", the host memory available."""
    if device.type != "cuda":
        return _host_memory()[1]
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))


def _measure_rates(device: torch.device, size_mib: int, adam_params: int, progress: bool,
                   threads: int, rank_threads: int) -> HardwareProfile:
    """The cacheable part: rates and bandwidths (the memory fields are left at 0). Host work
    on ``threads`` OpenMP threads (the node's rates), the update overhead with the kernel on
    ``rank_threads`` (as one rank runs it)."""
    from ..runtime.host_threads import omp_threads
    with omp_threads(threads):
        return _measure(device, size_mib, adam_params, progress, threads, rank_threads)


def _measure(device, size_mib, adam_params, progress, threads, rank_threads) -> HardwareProfile:
    say = (lambda msg: print(f"protrain: probe: {msg}", flush=True)) if progress else (lambda msg: None)
    nbytes = size_mib * 2**20
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        # Data-center GPUs copy each direction on its own engine; torch does not say how
        # many a device has (asyncEngineCount), so one per direction is assumed.
        engines = int(getattr(torch.cuda.get_device_properties(device), "async_engine_count", 2) or 2)
    else:
        name, engines = f"cpu ({_cpu_model()})", 0
    say(f"copy bandwidth ({size_mib} MiB, pinned)")
    h2d, d2h = _copy_bandwidth(device, nbytes)
    say(f"CPU Adam ({adam_params / 1e6:.0f} M params; DeepSpeedCPUAdam builds once, ~1 min)")
    cpu_adam = _cpu_adam_rate(adam_params)
    host_copy = _host_copy_bandwidth(adam_params)
    # The backup in the update's own pass, where the runtime's kernel on this device is the
    # native one (``runtime.uses_native_kernel``: CUDA; on a CPU "device" the engine measures
    # it only if asked for that kernel).
    backup = fused_backup_bandwidth(adam_params) if device.type == "cuda" else 0.0
    grad_check = _grad_check_rate(adam_params)
    host_pass = _host_pass_rate(adam_params)
    say("the runtime's time per chunk update")
    update_overhead = measure_update_overhead(threads=rank_threads)
    step_dispatch = measure_step_dispatch(threads=rank_threads)
    if device.type == "cuda":
        say(f"device Adam ({adam_params / 1e6:.0f} M params)")
        gpu_adam = _device_adam_rate(device, adam_params)
    else:
        gpu_adam = cpu_adam   # on a CPU "device" the runtime updates with the same CPU kernel
    return HardwareProfile(
        name=name, source="measured", device_type=device.type, device_memory=0, host_memory=0,
        h2d_bandwidth=h2d, d2h_bandwidth=d2h, gpu_adam_rate=gpu_adam, cpu_adam_rate=cpu_adam,
        host_copy_bandwidth=host_copy, backup_bandwidth=backup, grad_check_rate=grad_check,
        host_pass_rate=host_pass, host_update_overhead=update_overhead, step_dispatch_overhead=step_dispatch,
        copy_engines=min(engines, 2), cpu_cores=threads, versions=_versions())


def _best_time(fn, reps: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: torch.device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _copy_bandwidth(device: torch.device, nbytes: int) -> tuple[float, float]:
    from ..runtime.streams import Streams
    sync = _sync(device)
    streams = Streams(device)       # registered, then given back: not kept by torch's pinned cache
    host = streams.pinned(nbytes, torch.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:
        t_h2d = _best_time(lambda: dev.copy_(host, non_blocking=True), 3, sync)
        t_d2h = _best_time(lambda: host.copy_(dev, non_blocking=True), 3, sync)
    finally:
        streams.release_pinned()
    return nbytes / t_h2d, nbytes / t_d2h


def _device_adam_rate(device: torch.device, n: int) -> float:
    p = torch.nn.Parameter(torch.zeros(n, device=device))
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=device.type == "cuda", foreach=None)
    t = _best_time(opt.step, 3, _sync(device))
    return n / t


def _cpu_adam_rate(n: int) -> float:
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.full_like(p, 1e-3)
    try:
        from ..native import deepspeed_cpu_adam
        opt = deepspeed_cpu_adam([p], lr=1e-3)
    except Exception:  # noqa: BLE001 - no compiler / no deepspeed: torch's Adam is the fallback
        opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
    t = _best_time(opt.step, 3, lambda: None)
    return n / t


def _host_copy_bandwidth(n: int) -> float:
    """Bytes/s of ``copy_`` between fp32 host tensors (the backup of a speculative update)."""
    src, dst = torch.ones(n), torch.empty(n)
    t = _best_time(lambda: dst.copy_(src), 3, lambda: None)
    return 4 * n / t


BACKUP_ROUNDS = 5
"""Interleaved rounds of the native kernel with and without the backup (``fused_backup_bandwidth``)."""


def fused_backup_bandwidth(n: int, threads: int = 0) -> float:
    """Bytes/s of a speculative update's backup (master, exp_avg, exp_avg_sq: 12 bytes per
    parameter) taken in the native kernel's own pass, the way the runtime takes it: the best
    time of the update with the backup less the best without, over ``BACKUP_ROUNDS``
    interleaved rounds of ``n`` parameters. 0 where the kernel does not build, or where the
    difference is lost in the machine's noise (the backup is then priced as a copy)."""
    from ..native import NativeBuildError
    from ..runtime.adam import AdamHyper, NativeCPUAdamKernel
    try:
        kernel = NativeCPUAdamKernel(adamw=True, threads=threads)
    except NativeBuildError:
        return 0.0
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, bias_correction=True,
                  adamw=True)
    master, grad, m, v = torch.zeros(n), torch.full((n,), 1e-3), torch.zeros(n), torch.zeros(n)
    backup = [torch.empty(n) for _ in range(3)]
    plain = lambda: kernel.update(master, grad, m, v, 1, h)                   # noqa: E731
    backed = lambda: kernel.update(master, grad, m, v, 1, h, backup=backup)   # noqa: E731
    best = {plain: float("inf"), backed: float("inf")}
    backed()
    for _ in range(BACKUP_ROUNDS):
        for fn in (plain, backed):
            t0 = time.perf_counter()
            fn()
            best[fn] = min(best[fn], time.perf_counter() - t0)
    extra = best[backed] - best[plain]
    return 12.0 * n / extra if extra > 0 else 0.0


def _host_pass_rate(n: int) -> float:
    """fp32 elements/s of an in-place pass (a gradient region scaled by the clipping
    coefficient; zeroing runs at about the same rate on the 2-core CPU measured)."""
    g, coef = torch.full((n,), 1e-3), torch.tensor([0.5])
    t = _best_time(lambda: g.mul_(coef), 3, lambda: None)
    return n / t


def _grad_check_rate(n: int) -> float:
    """fp32 elements/s of a gradient norm on the host (what a clipping step checks per
    offloaded parameter; the fp16 overflow test is as fast)."""
    g = torch.full((n,), 1e-3)
    t = _best_time(lambda: g.float().norm(2), 3, lambda: None)
    return n / t


def probe_collective(dp, device: torch.device, size_mib: int = 64) -> float:
    """Per-rank all-gather bandwidth of the data-parallel group, bytes/s (every rank must call
    it; time = bytes * (world - 1) / world / bandwidth, the cost model's convention)."""
    if dp.world == 1:
        return 0.0
    import torch.distributed as dist
    shard = size_mib * 2**20 // dp.world
    buf = torch.zeros(shard * dp.world, dtype=torch.uint8, device=device)
    sync = _sync(device)

    def once():
        dp.all_gather_(buf, shard)
    dist.barrier(group=dp.group)
    t = _best_time(once, 3, sync)
    t = dp.broadcast_object(t)          # every rank plans with rank 0's figure
    return buf.numel() * (dp.world - 1) / dp.world / t


DUPLEX_SHARE = 0.7
"""A drive counts as reading and writing independently (``HardwareProfile.nvme_duplex``) where
half the probe file read while the other half was written took at most this share of the
two done one after the other: each direction kept most of its bandwidth."""


def _both_directions(store, f, buf: torch.Tensor, w_per_byte: float, r_per_byte: float) -> bool:
    """Whether reading one half of ``f`` while writing the other half (as the staging ring
    reads one chunk's states while writing back another's) took at most ``DUPLEX_SHARE`` of
    the time the two take one after the other at the bandwidths just measured."""
    half = buf.numel() // 2 // 4096 * 4096
    if half == 0:
        return False
    t0 = time.perf_counter()
    w = store.write(f, half, buf[half:2 * half])
    r = store.read(f, 0, buf[:half])
    w.result()
    os.fsync(f.fd)
    r.result()
    together = time.perf_counter() - t0
    return together <= DUPLEX_SHARE * half * (w_per_byte + r_per_byte)


def probe_storage(root, device: torch.device, size_mib: int = 256) -> dict:
    """NVMe figures of an SSD path with the backend the runtime will use: write and read
    bandwidth (bytes/s, best of 2), whether the two run side by side at about those rates
    (``_both_directions``), whether it is GPUDirect Storage, the free bytes. The test
    file is ``size_mib`` or half the free space, whichever is smaller (a drive with little
    room is measured less precisely rather than refused; the plan may need far less)."""
    import logging
    import shutil
    from pathlib import Path

    from ..runtime.storage import BlockFile, RunDirectory, StorageConfigError, choose_store
    from ..units import fmt_bytes
    run = RunDirectory(root, 0)
    free = shutil.disk_usage(run.path).free
    nbytes = min(size_mib * 2**20, free // 2 // 2**20 * 2**20)
    if nbytes < _MIN_STORAGE_PROBE:
        run.close()
        raise StorageConfigError(
            f"ssd_path {root} has {fmt_bytes(free)} free; the start-up bandwidth probe of the drive "
            f"needs {fmt_bytes(2 * _MIN_STORAGE_PROBE)}, and the activations a plan puts there need "
            f"space too: free space or choose another directory")
    if nbytes < size_mib * 2**20:
        logging.getLogger("protrain").warning(
            "protrain: ssd_path %s has %s free: the drive's bandwidth is measured with a %s file "
            "instead of %d MiB (less precise)", root, fmt_bytes(free), fmt_bytes(nbytes), size_mib)
    store = choose_store(device, run.path)
    try:
        f = BlockFile(Path(run.path) / "probe.bin", nbytes)
        # From device memory whatever the backend, as the runtime writes: the POSIX backend's
        # bounce through pinned host memory is part of what the tier costs on a GPU.
        raw = torch.randint(0, 255, (nbytes + 4096,), dtype=torch.uint8, device=device)
        skip = (-raw.data_ptr()) % 4096       # 4 KiB aligned: O_DIRECT, not the page cache
        buf = raw[skip:skip + nbytes]
        best_w = best_r = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            store.write(f, 0, buf).result()
            os.fsync(f.fd)
            best_w = min(best_w, time.perf_counter() - t0)
            t0 = time.perf_counter()
            store.read(f, 0, buf).result()
            best_r = min(best_r, time.perf_counter() - t0)
        duplex = _both_directions(store, f, buf, best_w / nbytes, best_r / nbytes)
        f.close()
        result = {"nvme_write_bandwidth": nbytes / best_w, "nvme_read_bandwidth": nbytes / best_r,
                  "nvme_duplex": duplex,
                  "nvme_gds": bool(getattr(store, "gds", False)), "backend": store.name}
    finally:
        store.close()
        run.close()
    result["nvme_free_bytes"] = shutil.disk_usage(root).free     # the test file removed
    return result


_MIN_STORAGE_PROBE = 2**20
"""Smallest test file the storage probe writes (below it the timing says little)."""


def probe_alltoall(dp, device: torch.device, size_mib: int = 32) -> float:
    """Per-rank all-to-all bandwidth over the data-parallel group, bytes/s (every rank must
    call it; time = bytes * (world - 1) / world / bandwidth, the convention the sequence-
    parallel cost term uses). Ulysses attention's all-to-alls run within groups of P of these
    ranks; one figure over the whole group stands for every P."""
    if dp.world == 1:
        return 0.0
    import torch.distributed as dist
    n = size_mib * 2**20 // dp.world * dp.world
    send = torch.zeros(n, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    sync = _sync(device)

    def once():
        dist.all_to_all_single(recv, send, group=dp.group)
    dist.barrier(group=dp.group)
    t = _best_time(once, 3, sync)
    t = dp.broadcast_object(t)          # every rank plans with rank 0's figure
    return n * (dp.world - 1) / dp.world / t
