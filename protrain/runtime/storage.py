"""Activation storage on NVMe: one interface, two backends, chosen automatically.

- ``kvikio`` with GPUDirect Storage: device memory <-> NVMe, no bounce through the host;
- ``posix``: a thread pool doing pread/pwrite (O_DIRECT when buffer, size and offset are
  aligned), everywhere else: CPU machines and CI, and GPUs without GDS. Device tensors are
  staged through a pinned bounce buffer per thread, copied on that thread's own stream
  (``Streams.copy_in_thread``), never on the compute stream. kvikio's compatibility mode
  would bounce the same way, but on streams that synchronise with the compute stream
  (``choose_store``), so it is not used.

Writes and reads are asynchronous (futures) on separate store and load pools; a write starts
only after the event of the stream that produced the data. Every error names the file and the
offset: a failed write or read stops training, it never yields a wrong gradient.

Files live in a per-run directory (``RunDirectory``) removed at normal exit, on exceptions
(``close``) and on SIGTERM / SIGHUP; one left by a killed process is removed by the next run
on the same root. The root is checked before training (exists, writable, enough free space
for what the plan needs).
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import errno
import fcntl
import logging
import os
import re
import shutil
import signal
import socket
import threading
import uuid
import zlib
from pathlib import Path

import torch

from ..units import fmt_bytes
from .streams import Streams

log = logging.getLogger("protrain")

ALIGN = 4096
"""Offsets in the files are aligned to this (O_DIRECT and GDS like 4 KiB)."""


class StorageIOError(RuntimeError):
    """An activation write or read failed; the message names the file and the offset."""


class StorageConfigError(ValueError):
    """The SSD path cannot be used; the message says why and how much space is needed."""


# ---- the per-run directory ----------------------------------------------------------------
_RUN_NAME = re.compile(r"^protrain-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")
_LOCK = ".lock"


class RunDirectory:
    """``<root>/protrain-<host>-<pid>-<id>``: created now, removed by ``close()``, at interpreter
    exit, and on SIGTERM / SIGHUP when the process had the default handler for them (a handler
    the program installed, or SIG_IGN, is left in place: the program decides whether it stops,
    and a process that keeps running still needs its files).

    A kill -9 (or a power loss) runs none of that: the directory stays, with the space its
    files reserved. Each run therefore holds an exclusive lock on ``<dir>/.lock`` while it
    lives (the kernel drops it when the process dies, however it dies), and every new
    RunDirectory first removes the run directories under the same root whose lock nobody
    holds."""

    _live: set["RunDirectory"] = set()
    _handlers_installed = False

    def __init__(self, root: str | os.PathLike, needed_bytes: int, *,
                 purpose: str = "the plan's swapped-to-SSD activations", knob: str = "n_ssd"):
        """``needed_bytes``: what ``purpose`` will write here (refused with both named when
        the drive has less free, and the plan's ``knob`` that puts it there)."""
        # Absolute now: a script that changes directory later must not strand the directory
        # (close() and the signal handlers remove it by this path).
        root = Path(os.path.abspath(root))
        if not root.exists():
            raise StorageConfigError(f"ssd_path {root} does not exist; create it or point ssd_path "
                                     f"at a directory on the NVMe drive")
        if not root.is_dir():
            raise StorageConfigError(f"ssd_path {root} is not a directory")
        if not os.access(root, os.W_OK | os.X_OK):
            raise StorageConfigError(f"ssd_path {root} is not writable by this process; fix its "
                                     f"permissions or choose another directory")
        remove_stale_runs(root)
        free = shutil.disk_usage(root).free
        if free < needed_bytes:
            raise StorageConfigError(
                f"ssd_path {root} has {fmt_bytes(free)} free but {purpose} need "
                f"{fmt_bytes(needed_bytes)}; free space, use a larger drive, or pin {knob} lower")
        name = f"protrain-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # Made as ``.<name>.new``, its lock file made and locked under another name and only
        # then renamed to ``.lock``, then the directory renamed: another process's sweep
        # (remove_stale_runs) sees the directory either without a lock file - kept, its
        # process being alive - or with the lock held, never with an unlocked lock file it
        # would take for a dead run's.
        making = root / f".{name}.new"
        making.mkdir()
        self._lock_fd = os.open(making / f"{_LOCK}.making", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        os.rename(making / f"{_LOCK}.making", making / _LOCK)
        self.path = root / name
        making.rename(self.path)
        self._owner = os.getpid()
        RunDirectory._live.add(self)
        RunDirectory._install_handlers()

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        RunDirectory._live.discard(self)

    @classmethod
    def _cleanup_all(cls) -> None:
        # A forked child (a data-loader worker) inherits the handlers, not the directories.
        for d in list(cls._live):
            if d._owner == os.getpid():
                d.close()

    @classmethod
    def _install_handlers(cls) -> None:
        if cls._handlers_installed:
            return
        cls._handlers_installed = True
        atexit.register(cls._cleanup_all)
        if threading.current_thread() is not threading.main_thread():
            return          # signal handlers can only be set from the main thread
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, cls._on_signal)

    @classmethod
    def _on_signal(cls, signum, frame) -> None:
        """The default action (terminate) would skip atexit: clean up, then take it."""
        cls._cleanup_all()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def remove_stale_runs(root: Path) -> list[Path]:
    """Remove the run directories under ``root`` left by processes that died without cleaning
    up (kill -9, power loss, a signal that skipped the handlers); returns them. A directory is
    stale when nobody holds its lock; one without a lock file (made by an older version) when
    it was made on this host by a process that no longer exists."""
    removed, freed = [], 0
    host = socket.gethostname()
    for d in root.iterdir():
        name = d.name
        if name.startswith(".") and name.endswith(".new"):      # killed while being made
            name = name[1:-len(".new")]
        m = _RUN_NAME.match(name)
        if m is None or not d.is_dir():
            continue
        lock = d / _LOCK
        if lock.exists():
            try:
                fd = os.open(lock, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue            # held: its process is alive
            stale = True
        else:
            fd = None
            stale = m["host"] == host and not _alive(int(m["pid"]))
        if stale:
            freed += _tree_bytes(d)
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
        if fd is not None:
            os.close(fd)
    if removed:
        log.warning("protrain: removed %d run director%s under %s left by processes that ended "
                    "without cleaning up (%s): %s", len(removed), "y" if len(removed) == 1 else "ies",
                    root, fmt_bytes(freed), ", ".join(d.name for d in removed))
    return removed


def _tree_bytes(d: Path) -> int:
    """Bytes of the files under ``d`` (for the report): those another process's sweep removes
    meanwhile count as nothing, not as an error."""
    total = 0
    try:
        for f in d.rglob("*"):
            try:
                total += f.stat().st_size if f.is_file() else 0
            except OSError:
                pass
    except OSError:
        pass
    return total


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- one file per swapped block ------------------------------------------------------------
class BlockFile:
    """A preallocated file holding one block's saved tensors for one iteration (bump
    allocation from offset 0 each iteration)."""

    def __init__(self, path: Path, capacity: int):
        self.path = path
        self.capacity = (capacity + ALIGN - 1) // ALIGN * ALIGN
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _reserve(self.fd, path, self.capacity)
        except BaseException:
            os.close(self.fd)
            path.unlink(missing_ok=True)
            raise
        try:
            self.fd_direct = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
        except OSError as e:   # tmpfs and some file systems refuse O_DIRECT
            self.fd_direct = None
            _say_buffered(path, e)
        self.used = 0

    def alloc(self, nbytes: int) -> int:
        off = self.used
        self.used = off + (nbytes + ALIGN - 1) // ALIGN * ALIGN
        if self.used > self.capacity:   # the block saved more than profiled: grow the file
            self.capacity = self.used
            os.ftruncate(self.fd, self.capacity)
        return off

    def reset(self) -> None:
        self.used = 0

    def close(self) -> None:
        for fd in (self.fd, self.fd_direct):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""posix_fallocate's answers that mean the file does not fit (the drive, a quota, a size limit)."""
_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})
"""Its answers that mean the file system cannot preallocate (some network file systems)."""


def _reserve(fd: int, path: Path, nbytes: int) -> None:
    """Give the file at ``path`` its ``nbytes`` of blocks now, so that no write in training
    finds the drive full part way (a sparse file would take its blocks only then, and fail
    with ENOSPC at some offset mid-run). Refused when they do not fit, naming the drive, the
    bytes needed and free, and the fix. A file system that cannot preallocate gets a sparse
    file, after checking the free space covers it, and says so."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except AttributeError:          # no posix_fallocate (macOS): as a file system without it
        why = "this platform has no posix_fallocate"
    except OSError as e:
        if e.errno in _NO_SPACE:
            os.ftruncate(fd, 0)     # what a failed fallocate allocated, back before measuring
            raise _no_room(path, nbytes, os.strerror(e.errno)) from None
        if e.errno not in _NO_FALLOCATE:
            raise StorageIOError(f"reserving {fmt_bytes(nbytes)} for {path} failed: {e}") from e
        why = f"its file system cannot preallocate ({os.strerror(e.errno)})"
    if shutil.disk_usage(path.parent).free < nbytes:
        raise _no_room(path, nbytes, why)
    os.ftruncate(fd, nbytes)
    log.warning("protrain: %s: %s; the file's %s are not reserved, and a write fails if other "
                "files fill the drive first", path, why, fmt_bytes(nbytes))


def _no_room(path: Path, nbytes: int, why: str) -> StorageConfigError:
    free = shutil.disk_usage(path.parent).free
    return StorageConfigError(
        f"cannot reserve {fmt_bytes(nbytes)} on the drive for {path} ({why}): it has "
        f"{fmt_bytes(free)} free. Free space on the drive, point ssd_path "
        f"at a larger one, or put less there (pin n_nvme / n_ssd lower; the planner measures the "
        f"free space at start-up, and other files may have taken it since)")


_SAID_BUFFERED: set[int] = set()
"""File systems (``st_dev``) whose refusal of O_DIRECT was said already in this process."""


def _say_buffered(path: Path, error: OSError) -> None:
    """One line per file system and process, at the first file made there (the start-up
    probe's, or the runtime's): reads and writes go through the page cache."""
    try:
        dev = os.stat(path.parent).st_dev
    except OSError:
        dev = -1
    if dev in _SAID_BUFFERED:
        return
    _SAID_BUFFERED.add(dev)
    log.warning("protrain: %s is on %s, which refuses O_DIRECT (%s): reads and writes of the files "
                "there go through the page cache (buffered I/O, using host memory for the cache)",
                path.parent, file_system_type(path.parent) or "a file system",
                os.strerror(error.errno) if error.errno else error)


# ---- backends ------------------------------------------------------------------------------
STAGE_BYTES = 4 * 2**20
"""Size of the POSIX backend's pinned bounce buffer, per I/O thread."""


class PosixStore:
    """pread/pwrite from thread pools. Device tensors go through a pinned bounce buffer."""

    name = "posix"
    shares_pcie = True

    def __init__(self, threads: int = 4, verify: bool = False, streams: Streams | None = None,
                 stage_host: bool = False):
        """``streams``: the runtime's (its device, pinned memory, the threads' binding);
        ``stage_host`` also bounces host tensors (tests of the staged path on CPU)."""
        bind = streams.bind_thread if streams is not None else None
        self.store_pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="protrain-ssd-store",
                                                initializer=bind)
        self.load_pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="protrain-ssd-load",
                                               initializer=bind)
        self.verify = verify
        self.streams = streams
        self.stage_host = stage_host
        self._local = threading.local()
        self._bounce_buffers: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def write(self, f: BlockFile, offset: int, src: torch.Tensor, after=None,
              regions: list[tuple[int, int]] | None = None) -> cf.Future:
        """Write the uint8 tensor ``src`` at ``offset``; returns a future of its CRC32 (or None),
        or with ``regions`` ((start, length) in ``src``, a host tensor) of a list of each
        region's CRC32 (or None): reads of parts of what was written check the parts they read
        (``read``'s ``checks``)."""
        if regions is not None and self._staged(src):
            raise ValueError("checksums of regions are taken of host tensors only")
        return self.store_pool.submit(self._write, f, offset, src, after, regions)

    def read(self, f: BlockFile, offset: int, dst: torch.Tensor, written: cf.Future | None = None,
             after=None, checks: list[tuple[int, int, int]] | None = None) -> cf.Future:
        """Read into the uint8 tensor ``dst`` once the write ``written`` is done (its CRC32 is
        checked in verify mode) and the producer event ``after`` has happened. ``checks``
        ((start, length) in ``dst``, the index of the region of ``written`` that is): the
        regions of a ``write(..., regions=...)`` this read covers, each checked on its own."""
        if checks is not None and self._staged(dst):
            raise ValueError("checksums of regions are taken of host tensors only")
        return self.load_pool.submit(self._read_after, f, offset, dst, written, after, checks)

    def _read_after(self, f, offset, dst, written, after, checks=None):
        if after is not None:
            after.synchronize()
        crc = written.result() if written is not None and not written.cancelled() else None
        if checks is None:
            return self._read(f, offset, dst, crc)
        self._read(f, offset, dst, None)
        if crc is not None:
            data = memoryview(dst.numpy()).cast("B")
            for start, length, index in checks:
                check_region(f, offset + start, data[start:start + length], crc[index])
        return None

    def _staged(self, t: torch.Tensor) -> bool:
        return t.device.type != "cpu" or self.stage_host

    def _bounce(self, t: torch.Tensor) -> torch.Tensor:
        """This thread's pinned bounce buffer (4 KiB aligned: O_DIRECT)."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            if self.streams is None:
                self.streams = Streams(t.device)
            raw = self.streams.pinned(STAGE_BYTES + ALIGN, torch.uint8)
            skip = (-raw.data_ptr()) % ALIGN
            buf = self._local.buf = raw[skip:skip + STAGE_BYTES]
            with self._lock:
                self._bounce_buffers.append(raw)
        return buf

    def _write(self, f, offset, src, after, regions=None):
        if after is not None:
            after.synchronize()
        if not self._staged(src):
            data = memoryview(src.numpy()).cast("B")
            self._pwrite(f, data, offset, src.data_ptr())
            if regions is not None:
                # Of what was handed to the drive: a later read compares against these.
                return [zlib.crc32(data[a:a + n]) for a, n in regions] if self.verify else None
            return zlib.crc32(data) if self.verify else None
        buf, crc = self._bounce(src), 0
        for i in range(0, src.numel(), STAGE_BYTES):
            n = min(STAGE_BYTES, src.numel() - i)
            self.streams.copy_in_thread(buf[:n], src[i:i + n])
            data = memoryview(buf[:n].numpy()).cast("B")
            self._pwrite(f, data, offset + i, buf.data_ptr())
            crc = zlib.crc32(data, crc) if self.verify else 0
        return crc if self.verify else None

    def _pwrite(self, f, data, offset, addr):
        try:
            _pwrite_all(f, data, offset, addr)
        except OSError as e:
            raise StorageIOError(f"writing {len(data)} bytes to {f.path} at offset {offset} failed: {e}") from e

    def _pread(self, f, buf, offset, addr):
        try:
            _pread_all(f, buf, offset, addr)
        except OSError as e:
            raise StorageIOError(f"reading {len(buf)} bytes from {f.path} at offset {offset} failed: {e}") from e

    def _read(self, f, offset, dst, crc):
        if not self._staged(dst):
            buf = memoryview(dst.numpy()).cast("B")
            self._pread(f, buf, offset, dst.data_ptr())
            got = zlib.crc32(buf) if crc is not None else None
        else:
            bounce, got = self._bounce(dst), 0
            for i in range(0, dst.numel(), STAGE_BYTES):
                n = min(STAGE_BYTES, dst.numel() - i)
                data = memoryview(bounce[:n].numpy()).cast("B")
                self._pread(f, data, offset + i, bounce.data_ptr())
                if crc is not None:
                    got = zlib.crc32(data, got)
                self.streams.copy_in_thread(dst[i:i + n], bounce[:n])
        if crc is not None and got != crc:
            raise StorageIOError(f"{f.path} at offset {offset}: the {dst.numel()} bytes read back fail "
                                 f"their checksum (the data on the drive changed)")
        return None

    def close(self) -> None:
        """Wait for the writes and reads running, drop those not started (nothing reads them
        any more), give the bounce buffers back."""
        self.store_pool.shutdown(wait=True, cancel_futures=True)
        self.load_pool.shutdown(wait=True, cancel_futures=True)
        for t in self._bounce_buffers:
            self.streams.unpin(t)
        self._bounce_buffers = []


def _direct_ok(f: BlockFile, addr: int, nbytes: int, offset: int) -> bool:
    return (f.fd_direct is not None and nbytes > 0 and addr % ALIGN == 0 and nbytes % ALIGN == 0
            and offset % ALIGN == 0)


def check_region(f: BlockFile, offset: int, data, crc: int) -> None:
    """Raise, naming the file and the offset, if ``data`` (read from ``f`` at ``offset``) is not
    what was written there (``crc``, taken at the write)."""
    if zlib.crc32(data) != crc:
        raise StorageIOError(
            f"{f.path} at offset {offset}: the {len(data)} bytes read back differ from what was "
            f"written there (checksum mismatch: the data on the drive changed - a failing drive, "
            f"or another process writing the file). Training stopped before using them: resume "
            f"from the last checkpoint (on a healthy drive, or without n_nvme)")


def _pwrite_all(f: BlockFile, data: memoryview, offset: int, addr: int) -> None:
    fd = f.fd_direct if _direct_ok(f, addr, len(data), offset) else f.fd
    done = 0
    while done < len(data):
        try:
            n = os.pwrite(fd, data[done:], offset + done)
        except OSError:
            if fd == f.fd:
                raise
            fd = f.fd    # O_DIRECT refused (alignment rules of this file system): buffered
            continue
        if n == 0:
            raise OSError("no progress (disk full?)")
        done += n


def _pread_all(f: BlockFile, buf: memoryview, offset: int, addr: int) -> None:
    fd = f.fd_direct if _direct_ok(f, addr, len(buf), offset) else f.fd
    done = 0
    while done < len(buf):
        try:
            n = os.preadv(fd, [buf[done:]], offset + done)
        except OSError:
            if fd == f.fd:
                raise
            fd = f.fd
            continue
        if n == 0:
            raise OSError(f"unexpected end of file at offset {offset + done}")
        done += n


class KvikioStore:
    """kvikio CuFile reads/writes straight from/to device memory with GPUDirect Storage
    (``choose_store`` takes it only then; in kvikio's compatibility mode its bounce copies
    would serialise with the compute stream)."""

    name = "kvikio"

    def __init__(self, threads: int = 4, verify: bool = False, streams: Streams | None = None,
                 root: Path | None = None):
        """``root``: the directory the files will live in (whether its file system takes
        GPUDirect Storage); ``streams``: the runtime's (the pool threads' device)."""
        import kvikio
        import kvikio.defaults
        self.kvikio = kvikio
        self.gds, self.reason = kvikio_gds(kvikio, root)
        # Below gds_threshold kvikio takes its POSIX path even with GDS: a bounce through a
        # CU_STREAM_DEFAULT stream, which serialises with the compute stream.
        settings = {"num_threads": threads, "gds_threshold": 0} if self.gds else {"num_threads": threads}
        try:
            kvikio.defaults.set(settings)
        except Exception:  # noqa: BLE001 - older kvikio: keep its defaults
            pass
        self.name = "kvikio (GPUDirect Storage)" if self.gds else "kvikio (compatibility mode)"
        self.shares_pcie = not self.gds
        bind = streams.bind_thread if streams is not None else None
        self.store_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="protrain-ssd-store",
                                                initializer=bind)
        self.load_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="protrain-ssd-load",
                                               initializer=bind)
        self.verify = verify
        self._files: dict[Path, object] = {}

    def _cufile(self, f: BlockFile):
        cu = self._files.get(f.path)
        if cu is None:
            cu = self._files[f.path] = self.kvikio.CuFile(f.path, "r+")
        return cu

    def write(self, f: BlockFile, offset: int, src: torch.Tensor, after=None) -> cf.Future:
        return self.store_pool.submit(self._write, f, offset, src, after)

    def read(self, f: BlockFile, offset: int, dst: torch.Tensor, written: cf.Future | None = None,
             after=None) -> cf.Future:
        return self.load_pool.submit(PosixStore._read_after, self, f, offset, dst, written, after)

    def _write(self, f, offset, src, after):
        if after is not None:
            after.synchronize()   # kvikio only orders itself after the legacy default stream
        try:
            n = self._cufile(f).pwrite(src, src.numel(), offset).get()
        except Exception as e:  # noqa: BLE001
            raise StorageIOError(f"writing {src.numel()} bytes to {f.path} at offset {offset} "
                                 f"failed: {e}") from e
        if n != src.numel():
            raise StorageIOError(f"short write to {f.path} at offset {offset}: {n} of {src.numel()} bytes")
        return zlib.crc32(memoryview(src.cpu().numpy())) if self.verify else None

    def _read(self, f, offset, dst, crc):
        try:
            n = self._cufile(f).pread(dst, dst.numel(), offset).get()
        except Exception as e:  # noqa: BLE001
            raise StorageIOError(f"reading {dst.numel()} bytes from {f.path} at offset {offset} "
                                 f"failed: {e}") from e
        if n != dst.numel():
            raise StorageIOError(f"short read from {f.path} at offset {offset}: {n} of {dst.numel()} bytes")
        if crc is not None and zlib.crc32(memoryview(dst.cpu().numpy())) != crc:
            raise StorageIOError(f"{f.path} at offset {offset}: the bytes read back fail their checksum")
        return None

    def close(self) -> None:
        """As PosixStore.close, then the cuFile handles."""
        self.store_pool.shutdown(wait=True, cancel_futures=True)
        self.load_pool.shutdown(wait=True, cancel_futures=True)
        for cu in self._files.values():
            try:
                cu.close()
            except Exception:  # noqa: BLE001
                pass


def _kvikio_compat(kvikio) -> bool:
    """Whether kvikio prefers its compatibility mode (POSIX I/O through its own bounce
    buffers, no cuFile): ``KVIKIO_COMPAT_MODE=ON``, or AUTO without a usable libcufile.
    ``kvikio.defaults`` is a submodule that kvikio 26.x's ``__init__`` does not import: read
    as an attribute it was missing on the first GPU run, and GDS was never detected."""
    import kvikio.defaults as defaults
    fn = getattr(defaults, "is_compat_mode_preferred", None)          # kvikio >= 24.12
    if fn is not None:
        return bool(fn())
    fn = getattr(defaults, "compat_mode", None)                       # older: a bool or an enum
    if fn is not None:
        v = fn()
        return v.name != "OFF" if hasattr(v, "name") else bool(v)
    return True


def _gds_available(kvikio) -> bool:
    """Whether the cuFile driver says GPUDirect Storage is available (nvidia-fs, or P2P DMA)."""
    import kvikio.cufile_driver as driver
    get = getattr(driver, "get", None)                                 # kvikio >= 25.02
    if get is not None:
        return bool(get("is_gds_available"))
    props = getattr(driver, "properties", None) or driver.DriverProperties()
    return bool(props.is_gds_available)


GDS_FILE_SYSTEMS = frozenset({"ext4", "xfs", "lustre", "gpfs", "wekafs", "beegfs"})
"""File systems cuFile reads and writes directly (local NVMe, or distributed ones with GDS
support); elsewhere kvikio falls back to POSIX for the file, whatever its global setting."""


def file_system_type(path) -> str | None:
    """Type of the file system ``path`` is on (the longest mount point above it)."""
    path = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = fields[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, fields[2]
    except OSError:
        return None
    return kind


def kvikio_gds(kvikio, root) -> tuple[bool, str]:
    """Whether kvikio's I/O on files under ``root`` goes through GPUDirect Storage, and if not
    why: kvikio does not prefer its compatibility mode, the cuFile driver says GDS is
    available, and ``root`` is on a file system cuFile serves (kvikio's AUTO mode falls back
    per file otherwise)."""
    if _kvikio_compat(kvikio):
        return False, "kvikio is in compatibility mode: no libcufile, or KVIKIO_COMPAT_MODE=ON"
    try:
        if not _gds_available(kvikio):
            return False, "the cuFile driver reports no GPUDirect Storage: nvidia-fs not loaded"
    except Exception as e:  # noqa: BLE001 - an older kvikio, no driver: assume the bounce
        return False, f"the cuFile driver cannot be queried: {type(e).__name__}: {e}"
    fs = file_system_type(root) if root is not None else None
    if fs not in GDS_FILE_SYSTEMS:
        return False, f"{root} is on {fs or 'an unknown file system'}, which cuFile does not serve"
    return True, f"GPUDirect Storage on {fs}"


def choose_store(device: torch.device, root: Path, *, verify: bool = False, threads: int = 4,
                 streams: Streams | None = None):
    """kvikio on CUDA when its I/O on ``root`` really is GPUDirect Storage (and it works: one
    round trip is tried), else POSIX. kvikio without GDS bounces through host memory on
    streams it creates with CU_STREAM_DEFAULT, which synchronise with the legacy default
    stream - PyTorch's compute stream - so each of its copies would wait for all the compute
    queued before it and hold back all that comes after: a barrier per I/O task. The POSIX
    backend bounces through its own pinned buffers on non-blocking streams. The choice and
    its reason are in ``store.reason`` (the engine prints them at start-up). ``streams``: the
    runtime's (default: new ones for ``device``)."""
    streams = streams or Streams(device)
    if device.type != "cuda":
        reason = "no CUDA device"
    else:
        try:
            import kvikio
            gds, reason = kvikio_gds(kvikio, root)
        except Exception as e:  # noqa: BLE001 - no kvikio, or one that needs libcuda
            gds, reason = False, f"kvikio is not usable: {type(e).__name__}: {e}"
        if gds:
            try:
                store = KvikioStore(threads, verify, streams=streams, root=root)
                probe = root / ".kvikio-probe"
                f = BlockFile(probe, ALIGN)
                buf = torch.zeros(ALIGN, dtype=torch.uint8, device=device)
                store.read(f, 0, buf, store.write(f, 0, buf)).result()
                f.close()
                probe.unlink(missing_ok=True)
                store.reason = reason
                return store
            except Exception as e:  # noqa: BLE001 - GDS announced but failing here
                reason = f"kvikio failed a GPUDirect Storage round trip: {type(e).__name__}: {e}"
                log.warning("protrain: %s; using the POSIX backend", reason)
    store = PosixStore(threads, verify, streams=streams)
    store.reason = reason
    return store
