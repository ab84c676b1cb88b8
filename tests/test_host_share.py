"""Ranks that share a host: the cost model prices each at its share of the host's rates, each
rank's CPU Adam takes its share of the cores, the probe's cache entry is one per threads and
ranks per node, and plans record the ranks per node (cost.host_share, runtime.node,
runtime.host_threads, measure.probe)."""
from __future__ import annotations

import json
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import chain_profile, slow_link
from protrain.cost.chunk_times import backup_times, check_times, chunk_transfer_times
from protrain.cost.time_model import simulate
from protrain.layout import build_layout
from protrain.plan import Plan
from protrain.runtime import host_threads
from protrain.runtime.node import NodeShare, from_launcher, node_share
from protrain.search import search
from protrain.units import fmt_bytes


def _layout(profile):
    return build_layout(profile, 100)          # chunk i holds part i's 100 parameters


def test_cpu_adam_per_rank_scales_with_ranks_per_node():
    """Hand-computed: 100 parameters a chunk at 25 parameters/s on the node; 0.5 s of the
    runtime's own work per chunk update, on 4 cores. With several ranks an update takes the
    longer of its share of the node's streaming and its own path (its stream at the node's
    rate plus its own time): the own time hides under the other ranks' streams."""
    profile = chain_profile((100, 100), pre_params=100)
    layout = _layout(profile)
    node = slow_link(host_update_overhead=0.5, cpu_cores=4, grad_check_rate=50.0,
                     host_copy_bandwidth=600.0)
    for ranks, adam in [(1, 100 / 25 + 0.5), (4, max(100 / (25 / 4), 100 / 25 + 0.5)),
                        # 8 ranks on 4 cores: two to a core, their Python time-shares it
                        (8, max(100 / (25 / 8), 100 / 25 + 0.5 * 2))]:
        hw = replace(node, ranks_per_node=ranks)
        up, down, t_adam = chunk_transfer_times(layout, profile, hw)
        assert t_adam == pytest.approx([adam] * 3, rel=1e-12)
        assert check_times(layout, hw) == pytest.approx([100 / (50 / ranks)] * 3, rel=1e-12)
        assert backup_times(layout, hw, t_adam) == pytest.approx([1200 / (600 / ranks)] * 3, rel=1e-12)
        # A CPU "device": its copies are host memory work, shared too.
        assert up == pytest.approx([400 / (80 / ranks)] * 3, rel=1e-12)
        # Every chunk offloaded, updated after backward: the CPU Adam busy time of the step.
        t = simulate(profile, layout, hw, 0, 3, np.zeros((1, 2), dtype=np.int8))
        assert t.cpu_optim_time[0] == pytest.approx(3 * adam, rel=1e-12)
    # A GPU's PCIe link is its own: its copies are not divided.
    gpu = replace(node, device_type="cuda", copy_engines=2, ranks_per_node=8)
    assert chunk_transfer_times(layout, profile, gpu)[0] == pytest.approx([400 / 80] * 3)
    # With data-parallel sharding on top: each rank's shard at its share of the rate.
    two = replace(node, ranks_per_node=2, collective_bandwidth=1e9)
    assert chunk_transfer_times(layout, profile, two, world=2)[2] == \
        pytest.approx([max(50 / (25 / 2), 50 / 25 + 0.5)] * 3, rel=1e-12)
    # An own time longer than the others' streams: the own path sets the pace.
    slow_own = replace(node, ranks_per_node=2, host_update_overhead=5.0)
    assert chunk_transfer_times(layout, profile, slow_own)[2] == pytest.approx([100 / 25 + 5.0] * 3, rel=1e-12)


def test_the_plan_records_ranks_per_node_and_old_plan_files_load():
    profile = chain_profile((100, 100), pre_params=100)
    plan = search(profile, replace(slow_link(), ranks_per_node=4))
    assert plan.ranks_per_node == 4
    assert "host shared by 4 ranks per node" in plan.explain().splitlines()[1]    # the machine line
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["ranks_per_node"] == 4 and Plan.from_dict(data) == plan
    node = slow_link().host_memory                  # the node's; each of its 4 ranks plans for a quarter
    assert data["node_host_memory"] == node and data["host_memory"] == node // 4
    del data["ranks_per_node"], data["node_host_memory"]     # a plan file written before the fields
    old = Plan.from_dict(data)
    assert old.ranks_per_node == 1 and old.knobs == plan.knobs and old.node_host_memory is None
    assert f"of {fmt_bytes(plan.host_memory)} (swapped" in old.explain()   # what it was checked against
    one = search(profile, slow_link())
    assert one.ranks_per_node == 1 and "ranks per node" not in one.explain()


def test_protrain_plan_eight_ranks_per_node(capsys):
    """The issue's command: 8 ranks on one node each update their shard at 1/8 of the host's
    CPU Adam rate - at least 4x the CPU Adam time per rank of 8 ranks on 8 hosts."""
    from protrain.cli import main
    cmd = ["plan", "--model", "llama2-13b", "--micro-batch", "4", "--seq", "2048", "--world", "8",
           "--host-memory", "512GiB", "--json"]
    plans = {}
    for ranks in (1, 8):
        assert main(cmd + ["--ranks-per-node", str(ranks)]) == 0
        plans[ranks] = json.loads(capsys.readouterr().out)
    assert plans[8]["ranks_per_node"] == 8 and plans[1]["ranks_per_node"] == 1
    assert "host shared by 8 ranks per node" in plans[8]["machine"]
    one, eight = (plans[r]["prediction"]["cpu_optim_time"] for r in (1, 8))
    assert eight >= 4 * one, (one, eight)
    assert main(cmd[:-1] + ["--ranks-per-node", "9"]) == 2
    err = capsys.readouterr().err
    assert "--ranks-per-node 9" in err and "from 1 to --world (8)" in err


def test_each_ranks_kernel_takes_its_share_of_the_cores(monkeypatch):
    assert NodeShare(ranks_per_node=8, local_rank=0, cores=64).threads == 8
    assert NodeShare(ranks_per_node=2, local_rank=1, cores=2).threads == 1
    assert NodeShare(ranks_per_node=8, local_rank=0, cores=4).threads == 1     # at least one
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert from_launcher(16) is None
    monkeypatch.setenv("LOCAL_SIZE", "4")            # deepspeed's launcher
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert from_launcher(16) == (4, 3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")      # torchrun
    assert from_launcher(16) == (8, 3) and from_launcher(2) == (2, 3)   # never above the world


def test_without_launcher_variables_one_all_gather_of_host_names_counts_the_local_ranks(monkeypatch):
    import socket

    import protrain.runtime.node as node_mod
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    hosts = ["a", "b", "a", "a"]
    calls = []

    def all_gather_object(out, obj, group=None):
        calls.append(obj)
        out[:] = hosts
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    monkeypatch.setattr(socket, "gethostname", lambda: "a")
    monkeypatch.setattr(node_mod, "node_cores", lambda: 12)

    class Rank2:
        world, rank, group = 4, 2, None
    share = node_share(Rank2())
    assert calls == ["a"]                           # one collective, this host's name
    assert (share.ranks_per_node, share.local_rank, share.threads) == (3, 1, 4)


def test_the_kernels_run_on_the_given_threads_and_give_the_same_bits():
    """DeepSpeed's kernel forks as many OpenMP threads as its calling thread is set to: the
    kernel sets its count for the call and puts the caller's back; the bits do not depend on
    it. The host worker thread runs its passes on the share too."""
    from protrain.runtime.adam import AdamHyper, CPUAdamKernel
    from protrain.runtime.optimizer import _bind_worker
    from protrain.runtime.options import OptimizerSetup
    from protrain.runtime.runtime import host_kernel
    h = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                  bias_correction=True, adamw=True)
    before = host_threads.thread_count()
    seen, out = [], []
    for threads in (1, 2):
        k = CPUAdamKernel(adamw=True, threads=threads)
        real = k._op.adam_update
        k._op = type("Op", (), {"adam_update": staticmethod(
            lambda *a: (seen.append(host_threads.thread_count()), real(*a)))})()
        g = torch.Generator().manual_seed(0)
        states = [torch.randn(4099, generator=g) for _ in range(4)]
        states[3].abs_()
        k.update(states[0], states[1], states[2], states[3], 1, h)
        out.append(states)
        assert host_threads.thread_count() == before           # the caller's count back
    assert seen == [1, 2]
    assert all(torch.equal(a, b) for a, b in zip(*out))
    setup = OptimizerSetup(param_groups=[], hyper=lambda g: h, adamw=True, cpu_adam="deepspeed",
                           cpu_adam_threads=3)
    kernel = host_kernel(torch.device("cpu"), setup)
    assert kernel.threads == 3
    got = []

    def worker():
        _bind_worker(type("S", (), {"bind_thread": lambda self: None})(), kernel)
        got.append(host_threads.thread_count())
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert got == [3] and host_threads.thread_count() == before


def test_the_probe_cache_is_keyed_on_threads_and_ranks_per_node(tmp_path, monkeypatch):
    from protrain.measure import probe
    measured = []

    def fake(device, size_mib, adam_params, progress, threads, rank_threads):
        measured.append((threads, rank_threads))
        return slow_link(name=f"measured with {threads}")
    monkeypatch.setattr(probe, "_measure_rates", fake)
    cpu = torch.device("cpu")
    kw = dict(cache_dir=tmp_path, size_mib=8, adam_params=2**18, progress=False)
    a = probe.probe_hardware(cpu, ranks_per_node=1, threads=4, **kw)
    b = probe.probe_hardware(cpu, ranks_per_node=2, threads=4, **kw)
    c = probe.probe_hardware(cpu, ranks_per_node=2, threads=2, **kw)
    again = probe.probe_hardware(cpu, ranks_per_node=2, threads=4, **kw)
    # the node's rates on all its threads; the overhead probe's kernel on one rank's share
    assert measured == [(4, 4), (4, 2), (2, 1)]
    assert (a.ranks_per_node, b.ranks_per_node, c.ranks_per_node, again.ranks_per_node) == (1, 2, 2, 2)
    keys = {probe.cache_key(cpu, t, r) for t, r in [(4, 1), (4, 2), (2, 2)]}
    assert len(keys) == 3
    entries = sorted(p.name for p in tmp_path.glob("hardware-*.json"))
    assert len(entries) == 3 and all(any(k in e for k in keys) for e in entries)
    assert not list(tmp_path.glob("*.tmp"))


def test_the_cpu_adam_worker_keeps_its_share_of_the_cores_after_its_first_torch_op():
    """Issue 35, item 2: the worker thread is given the rank's share of the cores at its start
    (``_bind_worker``), before its first torch op; torch's lazy per-thread initialisation used
    to reset the count at the first parallel region (a large copy), so every pass but the
    native kernel ran on torch's global count. A probe on the worker reads the count after a
    parallel copy, with a share other than torch's."""
    from types import SimpleNamespace
    from protrain.runtime.optimizer import HostWorker, _bind_worker
    from protrain.runtime.streams import Streams
    share = torch.get_num_threads() + 1
    seen = []

    def probe():
        a = torch.ones(1 << 23)
        torch.empty(1 << 23, dtype=torch.bfloat16).copy_(a)       # a parallel region
        seen.append(host_threads.thread_count())
    worker = HostWorker(threaded=True, bind=lambda: _bind_worker(Streams(torch.device("cpu")),
                                                                 SimpleNamespace(threads=share)))
    worker.submit(probe)
    worker.drain()
    worker.close()
    assert seen == [share]


def test_the_first_steps_host_check_runs_on_the_ranks_share_of_the_cores(monkeypatch):
    """Issue 35, item 9: the first step of a plan checks every offloaded gradient on the host,
    in step() on the training thread, whose OpenMP count torchrun sets to 1 with several ranks
    per node. It runs on the rank's share (here: the kernel's threads, all the cores)."""
    from dstrain import UNTIED, base_config, train, with_protrain
    from protrain.runtime.optimizer import ChunkOptimizer
    seen = []
    norm = ChunkOptimizer._global_norm

    def watched(self, inv_scale):
        seen.append((host_threads.thread_count(), self.host_kernel.threads))
        return norm(self, inv_scale)
    monkeypatch.setattr(ChunkOptimizer, "_global_norm", watched)
    before = host_threads.thread_count()
    host_threads.set_thread_count(1)                      # as torchrun leaves the training thread
    try:
        _, _, engine = train(with_protrain(base_config(gradient_clipping=1.0), chunk_size="110KiB",
                                           n_persist=1, n_buffer=4), UNTIED, 2)
        engine.destroy()
        after = host_threads.thread_count()
    finally:
        host_threads.set_thread_count(before)
    assert seen and all(n == share and share > 1 for n, share in seen), seen
    assert after == 1                                     # the training thread's count is put back


# Issue 37, item 6: --host-memory is the node's, as the machine line prints it; each of the
# node's ranks plans for its share. llama2-7b, micro-batch 32 x 4096 tokens on H200s: with
# the node's 32 GiB taken as each rank's, the plan held 16.7 GiB per rank (134 GiB a node).
# (every device chunk whole: sharded over the 8 devices the model's states fit them, and the
# host's share would bind nothing)
LONG_7B = ["plan", "--model", "llama2-7b", "--gpu", "h200", "--micro-batch", "32", "--seq", "4096",
           "--world", "8", "--pin", "n_shard=0"]


def _plan_json(capsys, *args) -> dict:
    from protrain.cli import main
    assert main(list(args) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_host_memory_is_the_nodes_and_each_rank_plans_for_its_share(capsys):
    from protrain.cli import main
    node = 32 * 2**30
    eight = _plan_json(capsys, *LONG_7B, "--ranks-per-node", "8", "--host-memory", "32GiB")
    assert eight["prediction"]["host_bytes"] <= node // 8
    assert eight["host_memory"] == node // 8 and eight["node_host_memory"] == node
    assert "host 32.0 GiB" in eight["machine"]
    # The node's 32 GiB as every rank's (what the planner did before): it takes more than 4 GiB,
    # so the share above is what bound the plan.
    whole = _plan_json(capsys, *LONG_7B, "--ranks-per-node", "8", "--host-memory", "256GiB")
    assert whole["prediction"]["host_bytes"] > node // 8
    # A node per rank: the rank has the node's 32 GiB and uses more than an eighth of it.
    one = _plan_json(capsys, *LONG_7B, "--ranks-per-node", "1", "--host-memory", "32GiB")
    assert one["host_memory"] == one["node_host_memory"] == node
    assert node // 8 < one["prediction"]["host_bytes"] <= node
    assert main(LONG_7B + ["--ranks-per-node", "8", "--host-memory", "32GiB"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("  host memory"))
    assert " of 4.0 GiB per rank (the node's 32.0 GiB / 8 ranks) " in row, row


def test_variants_refused_under_pins_cost_no_search_of_the_unpinned_plan(monkeypatch, capsys):
    """With n_shard pinned and a host share too small for some variants, each refused variant
    is diagnosed (would it fit without the pins?) and named among the notes by its
    diagnosis's first clause - without the search of the plan without the pins that only the
    whole message needs (a search per variant, never shown); and whether it fits without them
    is found in a few rounds of fitting, doubling each time, not a call per pair."""
    from protrain.search import loop
    unpinned, rounds = [], []
    monkeypatch.setattr(loop, "search", lambda *a, **kw: unpinned.append(a) or pytest.fail("searched"))
    real_fits = loop.fits

    def fits(*a):
        real = loop._SearchState.fit_lowest
        calls = []
        monkeypatch.setattr(loop._SearchState, "fit_lowest", lambda st, *b, **kw: calls.append(1) or real(st, *b, **kw))
        try:
            return real_fits(*a)
        finally:
            monkeypatch.setattr(loop._SearchState, "fit_lowest", real)
            rounds.append(len(calls))
    monkeypatch.setattr(loop, "fits", fits)
    plan = _plan_json(capsys, *LONG_7B, "--ranks-per-node", "8", "--host-memory", "32GiB")
    refused = [n for n in plan["notes"] if "does not fit: no plan fits with the pinned knobs {'n_shard': 0}: "
               "host memory too small" in n]
    assert refused and not unpinned
    assert rounds and max(rounds) <= 20, rounds      # 3.5 k pairs in all: 12 rounds at most


def test_a_model_that_fits_a_node_per_rank_but_not_eight_ranks_a_node_names_the_share(capsys):
    from protrain.cli import main
    cmd = ["plan", "--model", "llama2-13b", "--world", "8", "--host-memory", "32GiB", "--pin", "n_shard=0"]
    assert main(cmd + ["--ranks-per-node", "1"]) == 0
    capsys.readouterr()
    assert main(cmd + ["--ranks-per-node", "8"]) == 3
    err = capsys.readouterr().err
    for words in ("host memory too small", "but 4.0 GiB per rank (the node's 32.0 GiB / 8 ranks) is available",
                  "the node's 8 ranks need", "put fewer ranks on each node", "GiB of host memory per rank"):
        assert words in err, (words, err)


def test_one_rank_per_node_plans_as_when_host_memory_was_each_ranks(monkeypatch, capsys):
    """With a rank per node the share is the node's figure: the plans are those of the search
    comparing each rank's host bytes with ``host_memory`` itself (as it did before the share),
    field for field; with 8 ranks a node they are not (the comparison is patched)."""
    import importlib
    users = ["protrain.search.policy", "protrain.search.space", "protrain.search.evaluation",
             "protrain.search.diagnosis", "protrain.sp.longest"]
    cases = [["--model", "llama2-7b", "--micro-batch", "4"],
             ["--model", "llama3-8b", "--host-memory", "160GiB"],
             ["--model", "gpt2-1.5b", "--gpu", "rtx3090", "--micro-batch", "8"],
             LONG_7B[1:] + ["--ranks-per-node", "8", "--host-memory", "32GiB"]]

    def plans() -> list[dict]:
        out = [_plan_json(capsys, "plan", *c) for c in cases]
        for p in out:
            del p["search_seconds"]
        return out
    share = plans()
    for name in users:
        monkeypatch.setattr(importlib.import_module(name), "host_memory_share", lambda hw: hw.host_memory)
    whole = plans()
    assert share[:-1] == whole[:-1]
    assert share[-1]["knobs"] != whole[-1]["knobs"]


def test_the_probes_update_overhead_steps_on_the_ranks_threads(monkeypatch):
    """The probe times the runtime's step around a wrapped kernel; the step takes its thread
    count off the kernel, so the wrapper carries the kernel's (the verdict and norm measured on
    one thread would price a rank's steps at the wrong share)."""
    pytest.importorskip("deepspeed")
    from protrain.measure.update_overhead import measure_update_overhead
    from protrain.runtime.optimizer import ChunkOptimizer
    seen = []
    norm = ChunkOptimizer._global_norm

    def watched(self, inv_scale):
        seen.append(host_threads.thread_count())
        return norm(self, inv_scale)
    monkeypatch.setattr(ChunkOptimizer, "_global_norm", watched)
    before = host_threads.thread_count()
    host_threads.set_thread_count(1)
    try:
        measure_update_overhead(reps=1, threads=2)
    finally:
        host_threads.set_thread_count(before)
    assert seen and all(n == 2 for n in seen), seen
