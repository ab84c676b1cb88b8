"""Starting a multi-rank test's processes (one per rank, gloo on CPU).

Through a fork server that has loaded torch, DeepSpeed and its CPU ops once (rank_preload.py):
each rank is forked from it instead of a fresh interpreter loading them again (about 10 s of
CPU per rank on the CI machine, most of a short two-rank test). The server runs no tensor work before it forks,
so no thread pool or OpenMP team is copied into a rank half-made; a rank sets its own
environment (RANK, MASTER_PORT, ...) before it builds anything, on top of the launching test's
(which a forked process would not see otherwise). Every launch is bounded: ranks
still running after ``timeout`` seconds are killed and the test fails saying so."""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import sys
import time

PRELOAD = ["rank_preload"]


def _start_server() -> None:
    """The fork server, started once with this directory on its path: Python 3.11's server
    imports its preload list before it applies the parent's sys.path (and skips a module it
    cannot import without a word), so it is given PYTHONPATH for its start."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    here = os.path.dirname(os.path.abspath(__file__))
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([here] + ([before] if before else []))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def _in_environment(rank: int, env: dict, fn, *args) -> None:
    """A forked rank starts with the server's environment: it takes the launching test's (as
    a spawned process would), then runs ``fn``."""
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def start_ranks(fn, args: tuple, world: int, timeout: float = 600.0) -> None:
    """``fn(rank, *args)`` in ``world`` processes; returns when all have ended (raises if one
    failed, with its traceback, or if they outlive ``timeout``)."""
    import torch.multiprocessing as mp
    _start_server()
    ctx = mp.start_processes(_in_environment, args=(dict(os.environ), fn, *args), nprocs=world,
                             start_method="forkserver", join=False)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks of {getattr(fn, '__name__', fn)} still running "
                                   f"after {timeout:.0f} s: killed")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()


def _script(rank: int, path: str, args: list[str]) -> None:
    sys.argv = [path, str(rank), *args]
    runpy.run_path(path, run_name="__main__")


def run_script_ranks(path: str, args: list[str], world: int, timeout: float = 300.0) -> None:
    """``python PATH RANK *ARGS`` for each rank, forked from the server like ``start_ranks``."""
    start_ranks(_script, (path, list(args)), world, timeout)
