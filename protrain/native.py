"""Builds and loads the native pieces in csrc/ (compiled on first use, cached per machine).

The model is DeepSpeed's op builder, and its CPU flags are reused as they are
(``CPUAdamBuilder.cxx_args`` of DeepSpeed's CPU op builders: ``-O3 -march=native -fopenmp`` and
the SIMD width it detects), so DeepSpeed's Adam kernel source (``csrc/adam/cpu_adam_impl.cpp`` of
the installed DeepSpeed) compiles here exactly as it does in DeepSpeed's own op. The build goes
through ``torch.utils.cpp_extension.load``: its cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) holds one build per content of the sources and flags (its
directory's name carries their hash, see ``_build_dir``), so a changed source builds anew and
an unchanged one loads in milliseconds.

Where csrc/ lives: at the repository root in a source checkout (editable install), copied into
the package as ``protrain/csrc`` by a regular install (setup.py).
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

log = logging.getLogger("protrain")

_lock = threading.Lock()
_loaded: dict[str, object] = {}

LOCK_WAIT_WARN_S = 5.0
"""Seconds a build or load may wait on ``torch.utils.cpp_extension``'s lock file before
ProTrain says which file it is waiting for (the wait itself has no end: a build killed midway
leaves the file behind, and every later load waits on it, silently)."""


class NativeBuildError(RuntimeError):
    """A native piece could not be compiled or loaded; the message says why and what to do."""


def csrc_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parent / "csrc"):
        if (candidate / "cpu_adam.cpp").exists():
            return candidate
    raise NativeBuildError(f"ProTrain's native sources (csrc/cpu_adam.cpp) are not installed next to "
                           f"{here}; reinstall the package (pip install protrain) or set "
                           f"\"cpu_adam\": \"deepspeed\" in the protrain section")


def _deepspeed_csrc() -> Path:
    import deepspeed.ops
    root = Path(deepspeed.ops.__file__).resolve().parent / "csrc"
    if not (root / "adam" / "cpu_adam_impl.cpp").exists():
        raise NativeBuildError(f"DeepSpeed's CPU Adam source is missing under {root} (a DeepSpeed "
                               f"install without csrc); reinstall deepspeed==0.19.8 from PyPI")
    return root


def cpu_adam():
    """The native CPU Adam module (csrc/cpu_adam.cpp + DeepSpeed's cpu_adam_impl.cpp)."""
    name = "protrain_cpu_adam"
    with _lock:
        if name in _loaded:
            return _loaded[name]
        from deepspeed.ops.op_builder.cpu.cpu_adam import CPUAdamBuilder
        from torch.utils.cpp_extension import load
        ds = _deepspeed_csrc()
        with cpu_info_once():
            flags = [f for f in CPUAdamBuilder().cxx_args() if f] + ["-UC10_USE_GLOG"]
        sources = [str(csrc_dir() / "cpu_adam.cpp"), str(ds / "adam" / "cpu_adam_impl.cpp")]
        build_dir = _build_dir(name, sources, flags)
        try:
            with watch_build_lock(build_dir, "ProTrain's native CPU Adam"):
                module = load(name=name, sources=sources, build_directory=build_dir,
                              extra_include_paths=[str(ds / "includes")], extra_cflags=flags,
                              extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as e:   # noqa: BLE001 - compiler / ninja / loader errors, re-raised below
            raise NativeBuildError(_explain(e, sources, flags)) from e
        _loaded[name] = module
        return module


def deepspeed_cpu_adam(*args, **kwargs):
    """``DeepSpeedCPUAdam(*args, **kwargs)``, its op built or loaded under
    ``watch_build_lock`` (a DeepSpeed install without prebuilt ops compiles it on first use with
    ``torch.utils.cpp_extension.load``, in torch's default build directory for the op's name)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    deepspeed_cpu_adam_op()
    return DeepSpeedCPUAdam(*args, **kwargs)


def deepspeed_cpu_adam_op():
    """DeepSpeed's CPU Adam op (``CPUAdamBuilder().load()``, kept by DeepSpeed once loaded),
    built or loaded under ``watch_build_lock``."""
    from deepspeed.ops.op_builder import CPUAdamBuilder
    with watch_build_lock(_torch_build_dir(CPUAdamBuilder.NAME), "DeepSpeed's CPU Adam op"), cpu_info_once():
        return CPUAdamBuilder().load()


_cpu_info: dict = {}
_cpu_info_lock = threading.Lock()     # held for the patch's bookkeeping and the one query only


def _fresh_lock_after_fork() -> None:
    global _cpu_info_lock
    _cpu_info_lock = threading.Lock()     # a fork inherits it as taken if a thread held it


os.register_at_fork(after_in_child=_fresh_lock_after_fork)


def _cpu_info_memo() -> dict:
    with _cpu_info_lock:
        if "info" not in _cpu_info:
            _cpu_info["info"] = _cpu_info["real"]()
        return copy.deepcopy(_cpu_info["info"])     # the caller's to change


@contextlib.contextmanager
def cpu_info_once():
    """Around a DeepSpeed op builder's ``cxx_args()`` or ``load()``: py-cpuinfo's
    ``get_cpu_info`` answered once per process. The builder asks it for the compiler flags at
    every JIT load, twice (the architecture, the SIMD width), and each answer runs a subprocess
    (1.2 s on this VM): 4.6 s of every rank's start-up where both CPU Adam ops load. Patched
    while any such call runs (counted: loads on several threads overlap); no lock is held over
    the call itself, which may wait minutes on another process's build."""
    try:
        import cpuinfo
    except ImportError:          # DeepSpeed falls back to lscpu
        yield
        return
    with _cpu_info_lock:
        if not _cpu_info.get("depth"):
            _cpu_info["real"] = cpuinfo.get_cpu_info
            cpuinfo.get_cpu_info = _cpu_info_memo
        _cpu_info["depth"] = _cpu_info.get("depth", 0) + 1
    try:
        yield
    finally:
        with _cpu_info_lock:
            _cpu_info["depth"] -= 1
            if not _cpu_info["depth"]:
                cpuinfo.get_cpu_info = _cpu_info["real"]


@contextlib.contextmanager
def watch_build_lock(build_dir: str | Path | None, what: str, after: float | None = None):
    """Around a ``torch.utils.cpp_extension`` build or load in ``build_dir``: if it is still
    running after ``after`` seconds (default ``LOCK_WAIT_WARN_S``) while the build's lock file
    is there, say once which file it waits for and what to do. torch waits on that file with
    no time limit and no word; another process's build holds it for a minute or two, a build
    killed midway forever."""
    done = threading.Event()
    wait = LOCK_WAIT_WARN_S if after is None else after
    lock = Path(build_dir) / "lock" if build_dir is not None else None

    def watch():
        if not done.wait(wait) and lock is not None and lock.exists():
            log.warning(
                "ProTrain: loading %s has waited %.0f s for the build lock %s. Another process may "
                "be building it (the wait then ends when that build does, usually within a few "
                "minutes). If no other build is running, a build was killed midway and left the "
                "lock behind: delete %s and loading goes on.", what, wait, lock, lock)

    watcher = threading.Thread(target=watch, name="protrain-build-lock-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


def _torch_build_dir(name: str) -> str | None:
    """torch's default build directory of an extension named ``name`` (what
    ``torch.utils.cpp_extension.load`` uses without ``build_directory``); None if this torch
    does not say."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
        return _get_build_directory(name, False)
    except (ImportError, AttributeError, TypeError, OSError):
        return None


def _build_dir(name: str, sources: list[str], flags: list[str]) -> str:
    """This build's directory: ``<name>_<hash>`` under ``TORCH_EXTENSIONS_DIR`` (default
    ``~/.cache/torch_extensions``), the hash of the sources' paths and text, the flags,
    Python's and torch's versions. torch's default, one directory per name, is shared by every
    checkout using this cache: checkouts with different sources rebuild over each other, and a
    process that finds another one's build under way waits for it and loads that build -- the
    other checkout's code. The paths too: ninja rebuilds what a build file names anew, so two
    checkouts of the same sources sharing a directory would rebuild over each other (70 s here)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root
    h = hashlib.sha1()
    for src in sources:
        h.update(Path(src).read_bytes())
    h.update("\0".join([*sources, *flags, sys.version, torch.__version__]).encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    path = Path(root) / f"{name}_{h.hexdigest()[:12]}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _explain(e: BaseException, sources: list[str], flags: list[str]) -> str:
    text = str(e).strip()
    tail = "\n".join(text.splitlines()[-15:])
    if "ninja" in text.lower() and "not" in text.lower():
        hint = "install ninja (pip install ninja)"
    elif "g++" in text or "c++" in text or "error:" in text:
        hint = "install a C++17 compiler (g++ >= 9) and check the error above"
    else:
        hint = "see the error above"
    return (f"ProTrain: building the native CPU Adam failed ({hint}).\n"
            f"  sources: {' '.join(sources)}\n  flags: {' '.join(flags)}\n  python: {sys.executable}\n"
            f"  build cache: {os.environ.get('TORCH_EXTENSIONS_DIR', '~/.cache/torch_extensions')}\n"
            f"{tail}\nTo train without it, set \"cpu_adam\": \"deepspeed\" in the protrain section "
            f"(DeepSpeed's kernel: same results, holds the Python GIL while it runs).")
