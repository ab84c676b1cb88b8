"""SSD activation tier: storage round trips, SSD blocks in training, forwarding, dedup,
cleanup (normal exit, exception, SIGTERM), refusals and I/O errors naming file and offset."""
import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from dstrain import UNTIED, base_config, train, with_protrain

from protrain.block_mode import BlockMode
from protrain.config import ConfigError
from protrain.runtime.storage import (BlockFile, PosixStore, RunDirectory, StorageConfigError,
                                      StorageIOError)

SSD_PLAN = dict(chunk_size="110KiB", n_persist=2, n_buffer=4, n_ssd=2, n_swap=1, n_checkpoint=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.bool, torch.int64])
def test_posix_round_trip_every_dtype_and_non_contiguous_inputs(dtype, tmp_path):
    run = RunDirectory(tmp_path, 2**20)
    f = BlockFile(run.path / "b.act", 2**16)
    store = PosixStore(verify=True)
    src = (torch.randn(37, 19) * 4).to(dtype).t()            # non-contiguous
    flat = src.contiguous().reshape(-1).view(torch.uint8)
    off = f.alloc(flat.numel())
    back = torch.empty_like(flat)
    store.read(f, off, back, store.write(f, off, flat)).result()
    assert torch.equal(back.view(dtype).view(src.shape), src)
    assert off % 4096 == 0 and f.alloc(1) % 4096 == 0
    store.close()
    f.close()
    run.close()
    assert not run.path.exists()


def test_ssd_blocks_train_like_deepspeed_and_clean_up(tmp_path):
    from test_ds_engine import deepspeed_run
    ref_losses, ref_weights = deepspeed_run(UNTIED, "{}", 6)
    cfg = with_protrain(base_config(), ssd_path=str(tmp_path), ssd_min_bytes=0, ssd_verify=True,
                        **SSD_PLAN)
    losses, weights, engine = train(cfg, UNTIED, 6)
    assert engine.protrain_plan.block_modes[:3] == (BlockMode.SSD, BlockMode.SSD, BlockMode.SWAP)
    assert losses == ref_losses                               # bit for bit, fp32
    for name, w in ref_weights.items():
        assert torch.equal(weights[name], w), name
    acts = engine.protrain_runtime.activations
    st = acts.stats
    assert acts.storage_backend == "posix"
    assert st["ssd_written_bytes"] > 0 and st["swap_dedup_hits"] > 0
    # everything written came back, read from the drive or forwarded from memory
    assert st["ssd_read_bytes"] > 0
    rundir = acts.rundir.path
    assert rundir.exists() and sorted(p.name for p in rundir.iterdir()) == [".lock", "block0000.act", "block0001.act"]
    engine.destroy()
    assert not rundir.exists() and list(tmp_path.iterdir()) == []


class _BlockedStore(PosixStore):
    """A store whose first write waits for a release, so later writes are still queued."""

    def __init__(self):
        super().__init__(threads=1)
        self.gate = threading.Event()
        self.store_pool.submit(self.gate.wait)


def test_forwarding_returns_live_tensors_and_skips_their_pending_writes(tmp_path):
    from protrain.runtime.activations import ActivationRuntime
    from protrain.runtime.streams import Streams

    class Exp(torch.nn.Module):
        def forward(self, x):
            return torch.exp(x)           # saves its output, which the caller keeps alive
    blocks = [Exp(), Exp()]
    store = _BlockedStore()
    rt = ActivationRuntime(blocks, [BlockMode.SSD, BlockMode.SSD], Streams(torch.device("cpu")),
                           torch.device("cpu"), [2**16, 2**16], lambda t: None, ssd_root=tmp_path,
                           ssd_min_bytes=0, ssd_store=store)
    x = torch.randn(1000, requires_grad=True)
    with rt.hooks():
        rt.enter_forward_block(0)
        y0 = blocks[0](x)
        rt.enter_forward_block(1)
        y1 = blocks[1](y0)
    rt.current_block = None           # writes of both blocks are still queued behind the gate
    y1.sum().backward()               # unpack: y1 and y0 are alive -> forwarded
    assert rt.stats["forwarded"] == 2 and rt.stats["writes_skipped"] == 2
    assert rt.stats["ssd_read_bytes"] == 0
    assert torch.allclose(x.grad, torch.exp(torch.exp(x.detach())) * torch.exp(x.detach()))
    store.gate.set()
    rt.close()


def _script(tmp_path, body: str) -> Path:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from dstrain import UNTIED, base_config, train, with_protrain
        cfg = with_protrain(base_config(), ssd_path={str(tmp_path / 'ssd')!r}, ssd_min_bytes=0,
                            **{SSD_PLAN!r})
        """) + textwrap.dedent(body))
    (tmp_path / "ssd").mkdir()
    return script


@pytest.mark.parametrize("how", ["normal exit", "exception", "SIGTERM"])
def test_run_directory_is_removed(how, tmp_path):
    body = {"normal exit": "train(cfg, UNTIED, 2)\n",
            "exception": "train(cfg, UNTIED, 2)\nraise RuntimeError('boom')\n",
            "SIGTERM": "_, _, e = train(cfg, UNTIED, 2)\nprint('READY', flush=True)\ntime.sleep(120)\n"}[how]
    script = _script(tmp_path, body)
    env = {**os.environ, "MASTER_PORT": str(20000 + os.getpid() % 5000 + len(how))}  # not ours
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    if how == "SIGTERM":
        for line in proc.stdout:
            if "READY" in line:
                break
        assert list((tmp_path / "ssd").iterdir()), "the run directory should exist while training"
        proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert (proc.returncode != 0) == (how != "normal exit"), out[-2000:]
    assert list((tmp_path / "ssd").iterdir()) == [], how


def test_unusable_paths_are_refused_before_training(tmp_path, monkeypatch):
    missing = with_protrain(base_config(), ssd_path=str(tmp_path / "nope"), **SSD_PLAN)
    with pytest.raises(ConfigError, match="does not exist"):
        train(missing, UNTIED, 1)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        train(with_protrain(base_config(), ssd_path=str(a_file), **SSD_PLAN), UNTIED, 1)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p) == str(tmp_path) else real_access(p, m))
    with pytest.raises(ConfigError, match="not writable"):
        train(with_protrain(base_config(), ssd_path=str(tmp_path), **SSD_PLAN), UNTIED, 1)
    monkeypatch.undo()
    import shutil
    from protrain.search import InfeasibleError
    usage = shutil.disk_usage(tmp_path)

    def free(n):
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=n))
    cfg = with_protrain(base_config(), ssd_path=str(tmp_path), ssd_min_bytes=0, **SSD_PLAN)
    free(4096)      # too little even for the start-up bandwidth probe: it says so
    with pytest.raises(StorageConfigError, match=r"has 4.0 KiB free; the start-up bandwidth probe"):
        train(cfg, UNTIED, 1)
    # Less than the probe's usual 2 x 256 MiB, but what this plan needs (1 MiB): trains, with
    # the probe's test file sized to the drive.
    free(64 * 2**20)
    _, _, engine = train(cfg, UNTIED, 1)
    assert engine.protrain_plan.knobs.n_ssd == 2 and engine.protrain_plan.prediction.ssd_bytes < 2**21
    engine.destroy()
    # A plan that needs more than the drive has is refused as the plan's.
    free(5 * 2**19)
    with pytest.raises(InfeasibleError, match=r"writes .* MiB of activations to NVMe but the SSD path "
                                              r"has 2.5 MiB free"):
        train(with_protrain(base_config(train_micro_batch_size_per_gpu=8), ssd_path=str(tmp_path),
                            ssd_min_bytes=0, **SSD_PLAN), UNTIED, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]        # no run directory left


def test_io_errors_stop_training_naming_file_and_offset(tmp_path, monkeypatch):
    cfg = with_protrain(base_config(), ssd_path=str(tmp_path), ssd_min_bytes=0, **SSD_PLAN)
    real = os.pwrite
    # The drive fills up during training (the start-up probe's 256 MiB write still succeeds).
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: (_ for _ in ()).throw(OSError(28, "No space left on device"))
                        if 4096 < len(data) < 2**27 else real(fd, data, off))
    with pytest.raises(StorageIOError, match=r"block0000\.act at offset \d+ failed: .*No space left"):
        train(cfg, UNTIED, 1)


def test_closing_with_writes_and_reads_in_flight_waits_for_them_before_the_files(tmp_path, monkeypatch):
    """An out-of-memory re-plan closes the activation runtime while the SSD pools may still be
    writing and reading (slow writes injected). Each one running completes - without an error,
    its bytes in its file before that file is closed - and those not started are dropped
    (nothing reads them any more)."""
    from protrain.runtime import storage
    from protrain.runtime.activations import ActivationRuntime, _Stored
    from protrain.runtime.streams import Streams
    started = threading.Semaphore(0)
    pwrite = storage._pwrite_all

    def slow(f, data, offset, addr):
        started.release()
        time.sleep(0.3)
        pwrite(f, data, offset, addr)
    monkeypatch.setattr(storage, "_pwrite_all", slow)
    on_close = {}
    close = BlockFile.close

    def closing(f):                       # what each file holds when it is closed
        on_close[f.path.name] = os.pread(f.fd, f.used, 0) if f.fd is not None else None
        close(f)
    monkeypatch.setattr(BlockFile, "close", closing)
    acts = ActivationRuntime([torch.nn.Linear(4, 4)] * 2, [BlockMode.SSD] * 2, Streams(torch.device("cpu")),
                             torch.device("cpu"), [2**16] * 2, lambda t: None, ssd_root=tmp_path)
    writes = []
    for i in range(6):                    # 4 I/O threads: 4 writes run, 2 wait
        stash = acts.stashes[i % 2]
        src = torch.full((8192,), i + 1, dtype=torch.uint8)
        e = _Stored(storage=None, nbytes=src.numel())
        stash.begin_write(e, src)
        writes.append((stash.file.path.name, e, src))
    stash = acts.stashes[0]
    back = torch.zeros(8192, dtype=torch.uint8)
    stash.begin_read(writes[0][1], back, None)     # a read waiting for the first write
    for _ in range(4):
        assert started.acquire(timeout=10)
    acts.close()
    done = [e.out_done for _, e, _ in writes]
    assert all(f.done() for f in done)
    for name, e, src in writes:
        if not e.out_done.cancelled():
            assert e.out_done.exception() is None
            assert on_close[name][e.offset:e.offset + src.numel()] == bytes(src.numpy())
    assert writes[0][1].in_done.exception() is None and torch.equal(back, writes[0][2])
    assert sum(f.cancelled() for f in done) == 2


class _GatedStore(PosixStore):
    """A store whose reads and writes block until ``gate`` is set (slow NVMe)."""

    def __init__(self):
        super().__init__(threads=2)
        self.gate = threading.Event()
        self.running = threading.Semaphore(0)

    def _write(self, *args):
        self.running.release()
        self.gate.wait()
        return super()._write(*args)

    def _read(self, *args):
        self.running.release()
        self.gate.wait()
        return super()._read(*args)


def test_reset_waits_for_reads_and_writes_in_flight_before_dropping_their_buffers(tmp_path):
    """A reset after an error mid-backward: a prefetch read into a device buffer whose saved
    tensor was never unpacked, and a write from a device storage of a forward that did not
    finish, are still running. The reset returns only once both are over: their buffers are
    let go, and the block's file offsets reused by the next iteration, after the I/O."""
    import weakref
    from protrain.runtime.activations import ActivationRuntime, _Stored
    from protrain.runtime.streams import Streams
    store = _GatedStore()
    acts = ActivationRuntime([torch.nn.Linear(4, 4)], [BlockMode.SSD], Streams(torch.device("cpu")),
                             torch.device("cpu"), [2**16], lambda t: None, ssd_root=tmp_path,
                             ssd_min_bytes=0, ssd_store=store)
    stash = acts.stashes[0]
    read = _Stored(storage=lambda: None, nbytes=8192)            # its device storage is gone
    read.out_done = cf.Future()
    read.out_done.set_result(None)                                # written in an earlier step
    stash.stored[0] = read
    acts.prefetch(0)                                              # the read into device_back
    src = torch.full((8192,), 3, dtype=torch.uint8)
    write = _Stored(storage=weakref.ref(src.untyped_storage()), nbytes=8192, device_src=src)
    stash.begin_write(write, src)
    stash.stored[1] = write
    del src
    for _ in range(2):
        assert store.running.acquire(timeout=10)                  # both are running
    reset = threading.Thread(target=acts.reset)
    reset.start()
    reset.join(0.5)
    try:
        assert reset.is_alive(), "reset returned with a read and a write still in flight"
    finally:
        store.gate.set()                                          # a failure must not hang close
    reset.join(10)
    assert not reset.is_alive()
    assert read.in_done.done() and write.out_done.done()
    assert stash.stored == {} and stash.file.used == 0
    acts.close()


def test_verify_mode_catches_data_changed_on_the_drive(tmp_path):
    cfg = with_protrain(base_config(), ssd_path=str(tmp_path), ssd_min_bytes=0, ssd_verify=True,
                        **SSD_PLAN)
    _, _, engine = train(cfg, UNTIED, 1)
    from protrain.models import synthetic_batch
    x, y = synthetic_batch(UNTIED, 2, seed=7)
    loss = engine(x, y)
    f = engine.protrain_runtime.activations.stashes[0].file
    os.pwrite(f.fd, b"\xff" * 4096, 0)                          # the drive "changes" the data
    with pytest.raises(StorageIOError, match=r"block0000\.act at offset 0: .*checksum"):
        engine.backward(loss)


def _holder(root, *, before="", after="") -> str:
    """A process that makes a RunDirectory under ``root``, says READY and waits."""
    return textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        {before}
        from protrain.runtime.storage import RunDirectory
        run = RunDirectory({str(root)!r}, 0)
        (run.path / "block0000.act").write_bytes(b"x" * 4096)
        print("READY", run.path, flush=True)
        {after}
        time.sleep(60)
        """)


def _start(code: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("READY"), line
    return proc, Path(line.split()[1])


@pytest.mark.parametrize("sig, handler", [("SIGHUP", "default"), ("SIGTERM", "SIG_IGN"),
                                          ("SIGTERM", "the program's")])
def test_signals_clean_up_without_overriding_the_program(sig, handler, tmp_path):
    """The default action of SIGTERM / SIGHUP (terminate) skips atexit: the run directory is
    removed first. A SIGTERM the program ignores, or handles itself, keeps the process (and so
    its files, which it still uses) alive; they go at its exit."""
    # "default" sets it: a suite started under nohup hands its children SIGHUP ignored, and a
    # signal ignored at the start stays ignored (the program's choice, see the SIG_IGN case).
    before = {"default": f"signal.signal(signal.{sig}, signal.SIG_DFL)",
              "SIG_IGN": "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
              "the program's": "signal.signal(signal.SIGTERM, lambda s, f: print('HANDLED', flush=True))"}
    after = "time.sleep(1.0); print('EXISTS' if run.path.exists() else 'GONE', flush=True); sys.exit(0)" \
        if handler != "default" else ""
    proc, path = _start(_holder(tmp_path, before=before[handler], after=after))
    assert path.exists()
    proc.send_signal(getattr(signal, sig))
    out = proc.communicate(timeout=60)[0]
    if handler == "default":
        assert proc.returncode == -getattr(signal, sig)
    else:
        assert proc.returncode == 0 and "EXISTS" in out, (proc.returncode, out)   # still running, files there
        assert ("HANDLED" in out) == (handler == "the program's")
    assert list(tmp_path.iterdir()) == []


def test_run_directories_of_killed_processes_are_removed_by_the_next_run(tmp_path):
    """kill -9 skips every handler: the run directory (here the start-up probe's, with its test
    file) stays until the next RunDirectory under the same root removes it. A live run's
    directory, and one of another host, are left alone."""
    import socket
    probe = textwrap.dedent(f"""
        import sys, time, torch
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from protrain.runtime import storage
        from protrain.measure.probe import probe_storage
        def stuck(*args):
            print("READY probing", flush=True)
            time.sleep(60)
        storage.PosixStore._read = stuck
        probe_storage({str(tmp_path)!r}, torch.device("cpu"), size_mib=8)
        """)
    killed = subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline().startswith("READY")
    killed.kill()
    killed.wait()
    (left,) = tmp_path.iterdir()
    assert (left / "probe.bin").stat().st_size == 8 * 2**20
    alive, alive_path = _start(_holder(tmp_path))
    # made by an older version (no lock file): removed if its process is gone from this host
    dead_old = tmp_path / f"protrain-{socket.gethostname()}-{killed.pid}-0123abcd"
    other_host = tmp_path / f"protrain-elsewhere-{killed.pid}-0123abcd"
    for d in (dead_old, other_host):
        d.mkdir()
        (d / "block0000.act").write_bytes(b"x")
    run = RunDirectory(tmp_path, 0)
    assert sorted(tmp_path.iterdir()) == sorted([run.path, alive_path, other_host])
    alive.kill()
    alive.wait()
    run.close()
    again = RunDirectory(tmp_path, 0)
    assert sorted(tmp_path.iterdir()) == sorted([again.path, other_host])
    again.close()


def test_posix_backend_stages_device_tensors_through_its_pinned_bounce_buffer(tmp_path, monkeypatch):
    """Device tensors go through a per-thread pinned buffer in pieces, copied on the I/O
    thread's own stream (never the compute stream): exercised on CPU by staging host tensors
    too, with copies and thread binding checked by DeferredStreams."""
    from deferred_streams import DeferredStreams
    from protrain.runtime import storage
    monkeypatch.setattr(storage, "STAGE_BYTES", 64 * 1024)
    streams = DeferredStreams(torch.device("cpu"))
    run = RunDirectory(tmp_path, 2**22)
    f = BlockFile(run.path / "b.act", 2**20)
    store = PosixStore(threads=2, verify=True, streams=streams, stage_host=True)
    src = torch.randint(0, 255, (5 * 64 * 1024 + 1000,), dtype=torch.uint8)   # 5.x pieces
    off = f.alloc(src.numel())
    back = torch.zeros_like(src)
    store.read(f, off, back, store.write(f, off, src)).result()
    assert torch.equal(back, src)
    assert streams.pinned_bytes() > 0                 # the bounce buffers
    store.close()
    assert streams.pinned_bytes() == 0                # given back
    f.close()
    run.close()


def _fake_kvikio(monkeypatch, *, compat: bool, gds: bool, new_api: bool = True):
    """A kvikio module in the given state, importable: kvikio 26.x's API (defaults.
    is_compat_mode_preferred, cufile_driver.get) or an older one (defaults.compat_mode
    returning a CompatMode, cufile_driver.DriverProperties). As in kvikio 26.10, ``defaults``
    and ``cufile_driver`` are submodules the package's ``__init__`` does not import: they are
    importable, not attributes of ``kvikio`` until imported (the first GPU run found
    ``kvikio.defaults`` read as an attribute)."""
    import sys
    import types
    kvikio = types.ModuleType("kvikio")
    driver = types.ModuleType("kvikio.cufile_driver")
    defaults = types.ModuleType("kvikio.defaults")
    if new_api:
        defaults.is_compat_mode_preferred = lambda: compat
        driver.get = lambda key: {"is_gds_available": gds}[key]
    else:
        mode = types.SimpleNamespace(name="ON" if compat else "OFF")
        defaults.compat_mode = lambda: mode
        driver.DriverProperties = lambda: types.SimpleNamespace(is_gds_available=gds)
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setitem(sys.modules, "kvikio.cufile_driver", driver)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    return kvikio


@pytest.mark.parametrize("new_api", [True, False])
def test_kvikio_counts_as_gpudirect_only_with_the_driver_and_a_file_system_cufile_serves(
        new_api, tmp_path, monkeypatch):
    """kvikio's global setting says what it prefers, the cuFile driver whether GDS is there;
    whether a file's I/O bypasses the host depends on its file system (kvikio falls back per
    file)."""
    from protrain.runtime import storage
    kind = {"fs": "tmpfs"}
    monkeypatch.setattr(storage, "file_system_type", lambda path: kind["fs"])
    kvikio = _fake_kvikio(monkeypatch, compat=False, gds=True, new_api=new_api)
    gds, why = storage.kvikio_gds(kvikio, tmp_path)
    assert not gds and "tmpfs" in why
    kind["fs"] = "xfs"
    assert storage.kvikio_gds(kvikio, tmp_path) == (True, "GPUDirect Storage on xfs")
    gds, why = storage.kvikio_gds(_fake_kvikio(monkeypatch, compat=False, gds=False, new_api=new_api), tmp_path)
    assert not gds and "nvidia-fs" in why
    gds, why = storage.kvikio_gds(_fake_kvikio(monkeypatch, compat=True, gds=True, new_api=new_api), tmp_path)
    assert not gds and "compatibility mode" in why


@pytest.mark.parametrize("state", ["compat", "no driver", "tmpfs", "gds"])
def test_store_choice_on_cuda_takes_kvikio_only_with_gpudirect_storage(state, tmp_path, monkeypatch):
    """On a GPU without GPUDirect Storage kvikio would bounce through host memory on streams
    that synchronise with the compute stream (a barrier per I/O task): the POSIX backend is
    chosen instead, and the start-up report says why. With GDS kvikio is tried (here its
    round trip fails, there being no device: the POSIX backend again, saying so)."""
    from protrain.runtime import storage
    from protrain.runtime.streams import Streams
    _fake_kvikio(monkeypatch, compat=state == "compat", gds=state != "no driver")
    monkeypatch.setattr(storage, "file_system_type", lambda path: "tmpfs" if state == "tmpfs" else "xfs")
    tried = []

    class Kvikio:
        def __init__(self, *a, **k):
            tried.append(k["root"])
            raise RuntimeError("no device here")
    monkeypatch.setattr(storage, "KvikioStore", Kvikio)
    store = storage.choose_store(torch.device("cuda"), tmp_path, streams=Streams(torch.device("cpu")))
    try:
        assert isinstance(store, PosixStore)
        assert tried == ([tmp_path] if state == "gds" else [])
        assert {"compat": "compatibility mode", "no driver": "no GPUDirect Storage", "tmpfs": "tmpfs",
                "gds": "failed a GPUDirect Storage round trip"}[state] in store.reason
    finally:
        store.close()


def test_the_start_up_report_names_the_backend_and_why(tmp_path):
    from protrain.runtime.activations import ActivationRuntime
    from protrain.runtime.streams import Streams
    blocks = [torch.nn.Linear(4, 4)]
    acts = ActivationRuntime(blocks, [BlockMode.SSD], Streams(torch.device("cpu")), torch.device("cpu"),
                             [2**12], lambda t: None, ssd_root=tmp_path)
    assert acts.storage_backend == "posix" and acts.storage_choice == "posix (no CUDA device)"
    acts.close()


def test_file_system_type_reads_the_mount_table(tmp_path):
    from protrain.runtime.storage import file_system_type
    mounts = [line.split() for line in open("/proc/self/mounts")]
    root = [m[2] for m in mounts if m[1] == "/"]
    assert file_system_type("/") == root[-1]
    assert file_system_type(tmp_path) in {m[2] for m in mounts}


def test_a_file_that_does_not_fit_the_drive_is_refused_when_made_not_written_sparse(tmp_path, monkeypatch):
    """Issue 38, item 4: posix_fallocate's ENOSPC used to fall back to ftruncate - a sparse file
    whose writes failed mid-training on a drive that had looked large enough. Now it is refused
    when made, naming the file, the bytes needed and free, and the fix; nothing is left behind.
    A file system that cannot preallocate gets a sparse file only where the free space covers
    it, and says so."""
    import errno
    import shutil

    from protrain.runtime import storage

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(StorageConfigError) as e:
        BlockFile(tmp_path / "states.opt", 3 * 2**20)
    msg = str(e.value)
    assert f"cannot reserve 3.0 MiB on the drive for {tmp_path / 'states.opt'}" in msg
    assert "No space left on device" in msg and "free. Free space on the drive" in msg
    assert "pin n_nvme / n_ssd lower" in msg
    assert list(tmp_path.iterdir()) == []

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: usage._replace(free=2**20))
    with pytest.raises(StorageConfigError, match=r"cannot preallocate .*it has 1.0 MiB free"):
        BlockFile(tmp_path / "block.act", 3 * 2**20)
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: usage._replace(free=2**30))
    f = BlockFile(tmp_path / "block.act", 3 * 2**20)
    assert os.fstat(f.fd).st_size == 3 * 2**20
    f.close()


def test_a_sweep_of_stale_runs_between_lock_file_and_lock_cannot_remove_a_new_run(tmp_path, monkeypatch):
    """Issue 38, item 8: another process sweeping stale runs (``remove_stale_runs``) right while
    a RunDirectory is being made - here at the moment it locks its lock file - used to find
    that file unlocked, take the new directory for a dead run's and remove it (a raw
    FileNotFoundError at the rename). A flock is per open file: the sweep's own open and lock
    here act as another process's would."""
    import fcntl

    from protrain.runtime import storage
    real_flock = fcntl.flock
    swept = []

    def flock_after_a_sweep(fd, op):
        if op == fcntl.LOCK_EX and not swept:
            swept.append(storage.remove_stale_runs(tmp_path))
        return real_flock(fd, op)
    monkeypatch.setattr(storage.fcntl, "flock", flock_after_a_sweep)
    run = RunDirectory(tmp_path, 0)
    assert swept == [[]] and run.path.is_dir() and (run.path / ".lock").exists()
    monkeypatch.setattr(storage.fcntl, "flock", real_flock)
    assert storage.remove_stale_runs(tmp_path) == []          # held: left alone
    run.close()
    # Killed after making the directory, before its lock was in place: reaped as a dead run's.
    dead = tmp_path / f".protrain-{__import__('socket').gethostname()}-999999999-0123abcd.new"
    dead.mkdir()
    (dead / ".lock.making").write_bytes(b"")
    assert storage.remove_stale_runs(tmp_path) == [dead] and list(tmp_path.iterdir()) == []


def test_a_relative_ssd_path_is_resolved_when_configured(tmp_path, monkeypatch):
    """Issue 38, item 9: a relative ssd_path and a chdir in the script: the run directory is
    removed where it was made (its path absolute), and the DeepSpeed section's paths are made
    absolute at initialize, so the runtime uses the directory the script meant."""
    from protrain_ds.config import ProTrainDSConfig
    (tmp_path / "ssd").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    run = RunDirectory("ssd", 0)
    assert run.path.is_absolute() and run.path.parent == tmp_path / "ssd"
    monkeypatch.chdir(tmp_path / "elsewhere")
    run.close()
    assert list((tmp_path / "ssd").iterdir()) == []
    monkeypatch.chdir(tmp_path)
    cfg = ProTrainDSConfig.from_ds_config({"protrain": {
        "enabled": True, "ssd_path": "ssd", "plan_file": "plans/p.json", "trace_file": "t.json",
        "profile_cache_dir": "cache"}})
    assert (cfg.ssd_path, cfg.plan_file, cfg.trace_file, cfg.profile_cache_dir) == (
        str(tmp_path / "ssd"), str(tmp_path / "plans/p.json"), str(tmp_path / "t.json"), str(tmp_path / "cache"))


def test_a_file_system_without_o_direct_is_said_once(tmp_path, monkeypatch, caplog):
    """Issue 38, item 11: tmpfs (and others) refuse O_DIRECT; the files there are read and
    written through the page cache. That is said in one line, at the first file made on that
    file system (the start-up probe's or the runtime's), not again for the others."""
    import errno
    import logging

    from protrain.runtime import storage
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)
    monkeypatch.setattr(storage.os, "open", no_direct)
    monkeypatch.setattr(storage, "_SAID_BUFFERED", set(), raising=False)
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    with caplog.at_level(logging.WARNING, logger="protrain"):
        files = [BlockFile(tmp_path / f"block{i}.act", 4096) for i in range(3)]
    lines = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(lines) == 1 and f"{tmp_path} is on" in lines[0] and "page cache" in lines[0], lines
    assert all(f.fd_direct is None for f in files)
    for f in files:
        f.close()
