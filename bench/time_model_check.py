"""Bit-identity check of the step-time model (``protrain.cost.time_model.simulate``) across a
refactor: capture the inputs of many simulations once, replay them through the code before and
after, and diff the outputs (every field of every TimePrediction and every trace, exact reprs).

    # inputs: the search's candidates for CLI cases, random plans over many machines
    PYTHONPATH=$PWD python3 bench/time_model_check.py capture /tmp/tm/inputs.pkl
    # and every simulate call the given tests make (a pytest plugin records them)
    PYTHONPATH=$PWD python3 bench/time_model_check.py capture-tests /tmp/tm/tests.pkl tests/test_x.py ...
    # outputs of this checkout; run on both checkouts, then `cmp` the two files
    PYTHONPATH=$PWD python3 bench/time_model_check.py replay /tmp/tm/out.txt /tmp/tm/*.pkl

Inputs are pickled, so the replay is independent of timings measured while capturing (tests
that profile a model on the CPU give different profiles each run). Not a test: a tool for
refactors of the time model, where the predictions must not change by one bit.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import io
import pickle
import sys
from dataclasses import fields, replace
from pathlib import Path

import numpy as np

CLI_CASES = {
    # /work/plancheck/snapshot.sh's cases, plus the NVMe path without GPUDirect Storage.
    "7b-1gpu": "--model llama2-7b --micro-batch 2 --seq 2048 --gpu h100-pcie-80gb --host-memory 256GiB",
    "13b-8": "--model llama2-13b --micro-batch 4 --seq 2048 --world 8 --host-memory 512GiB --ranks-per-node 8",
    "13b-8r1": "--model llama2-13b --micro-batch 4 --seq 2048 --world 8 --host-memory 512GiB --ranks-per-node 1",
    "70b": "--model llama2-70b --micro-batch 1 --seq 4096 --world 8 --host-memory 1TiB",
    "gpt2-10b-clip": "--model gpt2-10b --micro-batch 8 --seq 1024 --clip 1.0 --host-memory 256GiB",
    "gpt2-small-fits": "--model gpt2-small --micro-batch 8 --seq 1024",
    "8b-long": "--model llama3-8b --micro-batch 1 --seq 65536 --world 8 --host-memory 1TiB",
    "8b-nvme": "--model llama3-8b --micro-batch 4 --seq 8192 --host-memory 64GiB --nvme 6 --gds",
    "8b-nvme-compat": "--model llama3-8b --micro-batch 4 --seq 8192 --host-memory 160GiB --nvme 6",
    "7b-fp16-small": "--model llama2-7b --micro-batch 1 --seq 1024 --dtype fp16 --device-memory 24GiB "
                     "--host-memory 128GiB",
    "infeasible": "--model llama2-70b --micro-batch 8 --seq 4096 --device-memory 24GiB --host-memory 64GiB",
    "pinned": "--model llama2-7b --micro-batch 2 --seq 2048 --pin n_persist=4 --host-memory 256GiB",
    "8b-nvme-fits": "--model llama3-8b --micro-batch 4 --seq 8192 --host-memory 160GiB --nvme 6 --gds --clip 1.0",
}


def time_model():
    """The module that holds ``simulate`` in this checkout (named before or after issue 26)."""
    for name in ("protrain.cost.time_model", "protrain.cost.runtime"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise SystemExit("no protrain.cost.time_model or protrain.cost.runtime on the path")


class Recorder:
    """Wraps ``simulate`` wherever it is bound and pickles each call's inputs to a stream."""

    def __init__(self, out) -> None:
        self.out = out
        self.label = ""
        self.calls = 0

    def install(self) -> None:
        mod = time_model()
        orig = mod.simulate

        def recording(*args, **kw):
            kw_in = dict(kw)
            if kw_in.get("trace") is not None:
                kw_in["trace"] = []
            pickle.dump((self.label, copy.deepcopy(args), copy.deepcopy(kw_in)), self.out)
            self.calls += 1
            return orig(*args, **kw)

        # Modules that imported the name before this ran hold the original: rebind them too.
        for m in list(sys.modules.values()):
            if m is not None and getattr(m, "simulate", None) is orig:
                m.simulate = recording
        mod.simulate = recording


def _cli_cases(rec: Recorder) -> None:
    from protrain import cli
    for name, argv in CLI_CASES.items():
        rec.label = f"cli:{name}"
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                cli.main(["plan", *argv.split(), "--json"])
            except SystemExit:
                pass
        print(f"{name}: {rec.calls} calls so far", file=sys.stderr)


def _machines():
    """Hardware variants that reach each branch of the model: copy engines 0/1/2, CPU Adam on
    a thread of its own, NVMe with and without GDS, measured host rates, ranks per node."""
    from protrain.profile.machines import MACHINES
    base = MACHINES["h100-pcie-80gb"].profile(host_memory=256 << 30)
    rtx = MACHINES["rtx3090"].profile()
    nvme = dict(nvme_write_bandwidth=5e9, nvme_read_bandwidth=6e9)
    return {
        "h100": base,
        "h100-gds": replace(base, **nvme, nvme_gds=True),
        "h100-nvme-compat": replace(base, **nvme, nvme_gds=False, ranks_per_node=4),
        "h100-measured-host": replace(base, host_copy_bandwidth=8e9, grad_check_rate=3e9,
                                      host_update_overhead=2e-4, ranks_per_node=8, cpu_cores=32),
        "one-engine": replace(rtx, copy_engines=1, **nvme, nvme_gds=True),
        "cpu-device": replace(rtx, copy_engines=0, device_type="cpu"),
        "cpu-device-thread": replace(rtx, copy_engines=0, device_type="cpu", cpu_adam_thread=True,
                                     **nvme, nvme_gds=False),
    }


def _shapes():
    from protrain.profile.analytic import PRESETS, ModelShape
    return [replace(PRESETS["gpt2-small"], micro_batch=8),
            replace(PRESETS["llama2-7b"], micro_batch=2, seq_len=2048),
            ModelShape("tiny-llama", "llama", 6, 512, 8, 32000, seq_len=512, micro_batch=4, kv_heads=2),
            ModelShape("tiny-gpt2", "gpt2", 4, 256, 4, 5000, seq_len=256, micro_batch=2)]


def _random_plans(rec: Recorder, rng: np.random.Generator, per_case: int) -> None:
    from protrain.layout import build_layout
    from protrain.profile.analytic import analytic_profile
    mod = time_model()
    for shape in _shapes():
        for hw_name, hw in _machines().items():
            prof = analytic_profile(shape, replace(hw, peak_flops=hw.peak_flops or 100e12))
            largest = max(p.numel for p in prof.params)
            total = sum(p.numel for p in prof.params)
            n_blocks = sum(p.kind == "block" for p in prof.parts)
            for chunk in sorted({largest, max(largest, total // 6), max(largest, total // 20)}):
                layout = build_layout(prof, chunk)
                table = layout.min_buffers_table()
                for case in range(per_case):
                    rec.label = f"random:{shape.name}:{hw_name}:{chunk}:{case}"
                    k = int(rng.choice([1, 1, 7, 40]))
                    npers = rng.integers(layout.min_persist, layout.n_chunks + 1, size=k)
                    nbuf = np.array([rng.integers(max(table[n], 1 if n < layout.n_chunks else 0),
                                                  layout.n_chunks + 1) for n in npers])
                    allowed = [0, 1, 2, 4] + ([3] if hw.nvme_write_bandwidth > 0 else [])
                    codes = rng.choice(allowed, size=(k, n_blocks)).astype(np.int8)
                    kw = dict(optimizer_step=bool(rng.random() < 0.8),
                              cpu_overlap=bool(rng.random() < 0.5),
                              world=int(rng.choice([1, 1, 4])) if hw.collective_bandwidth > 0 else 1,
                              carry_over=bool(rng.random() < 0.5),
                              checks_on_host=bool(rng.random() < 0.5))
                    if not kw["cpu_overlap"] and rng.random() < 0.6:
                        kw["speculate_from"] = rng.integers(0, layout.n_chunks + 1, size=k)
                        kw["speculation_wrong"] = bool(rng.random() < 0.5)
                    if k == 1 and rng.random() < 0.7:
                        kw["trace"] = []
                    with contextlib.suppress(ValueError):
                        mod.simulate(prof, layout, hw, npers, nbuf, codes, **kw)
                # Bad input: a plan without buffers, and too few buffers.
                rec.label = f"random:{shape.name}:{hw_name}:{chunk}:bad"
                for nb in (0, max(int(table[layout.min_persist]) - 1, 0)):
                    with contextlib.suppress(ValueError):
                        mod.simulate(prof, layout, hw, layout.min_persist, nb,
                                     np.zeros((1, n_blocks), dtype=np.int8))
                # SSD blocks on a machine without the NVMe bandwidths.
                with contextlib.suppress(ValueError):
                    mod.simulate(prof, layout, replace(hw, nvme_write_bandwidth=0.0), layout.n_chunks,
                                 0, np.full((1, n_blocks), 3, dtype=np.int8))


def capture(path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        rec = Recorder(out)
        rec.install()
        _cli_cases(rec)
        _random_plans(rec, np.random.default_rng(26), per_case=6)
    print(f"{rec.calls} simulate calls captured to {path}", file=sys.stderr)


class _Plugin:
    """pytest plugin: records simulate calls, labelled with the running test."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def pytest_runtest_setup(self, item) -> None:
        self.rec.label = f"test:{item.nodeid}"


def capture_tests(path: str, test_args: list[str]) -> int:
    import pytest
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        rec = Recorder(out)
        rec.install()
        rc = pytest.main(["-q", "-p", "no:cacheprovider", *test_args], plugins=[_Plugin(rec)])
    print(f"{rec.calls} simulate calls captured to {path}", file=sys.stderr)
    return int(rc)


def _repr(x) -> str:
    if isinstance(x, np.ndarray):
        return f"{x.dtype}{x.shape}:" + np.array2string(x, threshold=sys.maxsize, floatmode="unique",
                                                         max_line_width=sys.maxsize, separator=",")
    return repr(x)


def replay(out_path: str, inputs: list[str]) -> None:
    simulate = time_model().simulate
    n = 0
    with open(out_path, "w") as out:
        for path in inputs:
            with open(path, "rb") as f:
                while True:
                    try:
                        label, args, kw = pickle.load(f)
                    except EOFError:
                        break
                    n += 1
                    out.write(f"### {n} {label}\n")
                    try:
                        t = simulate(*args, **kw)
                    except ValueError as e:
                        out.write(f"ValueError: {e}\n")
                        continue
                    for fld in fields(t):
                        out.write(f"{fld.name} = {_repr(getattr(t, fld.name))}\n")
                    if kw.get("trace") is not None:
                        out.write(f"trace = {kw['trace']!r}\n")
    print(f"{n} simulations replayed into {out_path}", file=sys.stderr)


if __name__ == "__main__":
    np.set_printoptions(threshold=sys.maxsize)
    cmd, target, *rest = sys.argv[1:]
    if cmd == "capture":
        capture(target)
    elif cmd == "capture-tests":
        sys.exit(capture_tests(target, rest))
    elif cmd == "replay":
        replay(target, rest)
    else:
        raise SystemExit(__doc__)
