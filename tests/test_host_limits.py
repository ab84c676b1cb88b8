"""Host memory made real (issue 27, item 3): the limits this process has (MemAvailable, the
memory cgroup v2 or v1, RLIMIT_MEMLOCK) read from injected files, shared by a node's ranks;
the search's default host budget; a plan refused (or warned about) naming the numbers; and
pinning refused before the allocation instead of the OOM killer."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from protrain.runtime import host_limits
from protrain.runtime.host_limits import (HostLimits, HostPaths, PinnedMemoryError, check_pinning,
                                          read_host_limits)
from protrain.runtime.streams import Streams
from protrain.units import fmt_bytes

GiB, MiB, KiB = 2**30, 2**20, 2**10


def fake_host(root: Path, *, total: int, available: int, cgroup: str = "0::/",
              v2: dict[str, dict[str, str]] | None = None, v1: dict[str, dict[str, str]] | None = None,
              vmlck: int = 0) -> HostPaths:
    """A /proc and /sys/fs/cgroup of our making under ``root``: ``v2`` / ``v1`` map a cgroup
    directory (relative to the mount) to its files."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "meminfo").write_text(f"MemTotal:       {total // KiB} kB\nMemFree:        1 kB\n"
                                  f"MemAvailable:   {available // KiB} kB\n")
    (root / "cgroup").write_text(cgroup + "\n")
    (root / "status").write_text(f"Name:\tpython3\nVmLck:\t{vmlck // KiB} kB\n")
    for mount, tree in (("cg2", v2), ("cg1", v1)):
        (root / mount).mkdir(exist_ok=True)
        if mount == "cg2" and v2 is not None:
            (root / mount / "cgroup.controllers").write_text("cpu memory\n")
        for d, files in (tree or {}).items():
            (root / mount / d).mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                (root / mount / d / name).write_text(text + "\n")
    return HostPaths(meminfo=root / "meminfo", proc_cgroup=root / "cgroup", cgroup_v2=root / "cg2",
                     cgroup_v1_memory=root / "cg1", proc_status=root / "status")


def test_the_binding_limit_and_each_ranks_share_from_meminfo_and_cgroups(tmp_path):
    # cgroup v2: the job's memory.max binds (3 GiB less its working set: 1 GiB used, of which
    # 256 MiB inactive file cache the kernel reclaims first); the step below it has no limit.
    job = {"memory.max": str(3 * GiB), "memory.current": str(GiB),
           "memory.stat": f"anon 1\ninactive_file {256 * MiB}\nactive_file 5"}
    v2 = fake_host(tmp_path / "v2", total=64 * GiB, available=40 * GiB, cgroup="0::/job/step",
                   v2={"": {"memory.max": "max"}, "job": job,
                       "job/step": {"memory.max": "max", "memory.current": str(GiB)}})
    lim = read_host_limits(v2, ranks_per_node=4)
    room = 3 * GiB - (GiB - 256 * MiB)
    assert lim.cgroup == str(tmp_path / "v2/cg2/job/memory.max") and lim.cgroup_limit == 3 * GiB
    assert lim.binding == f"cgroup {lim.cgroup}" and lim.node_room == room
    assert lim.share == room // 4
    assert lim.mem_available == 40 * GiB and lim.mem_total == 64 * GiB
    # MemAvailable below the cgroup's room binds instead.
    tight = fake_host(tmp_path / "tight", total=64 * GiB, available=GiB, cgroup="0::/job/step",
                      v2={"job": job})
    lim = read_host_limits(tight, ranks_per_node=2)
    assert (lim.binding, lim.node_room, lim.share) == ("MemAvailable", GiB, GiB // 2)
    # A tighter limit deeper down (the leaf) binds over its ancestor's.
    leaf = fake_host(tmp_path / "leaf", total=64 * GiB, available=40 * GiB, cgroup="0::/job/step",
                     v2={"job": job, "job/step": {"memory.max": str(GiB), "memory.current": str(GiB // 4)}})
    lim = read_host_limits(leaf)
    assert lim.cgroup.endswith("job/step/memory.max") and lim.node_room == GiB - GiB // 4

    # cgroup v1 in a container: /proc/self/cgroup names a host path the mount does not show,
    # so the mount's root is this container's cgroup; its hierarchical limit (a parent job's)
    # is tighter than its own.
    v1 = fake_host(tmp_path / "v1", total=64 * GiB, available=40 * GiB,
                   cgroup="4:memory:/docker/abc\n0::/",
                   v1={"": {"memory.limit_in_bytes": str(4 * GiB), "memory.usage_in_bytes": str(GiB),
                            "memory.stat": f"hierarchical_memory_limit {2 * GiB}\n"
                                           f"total_inactive_file {128 * MiB}"}})
    lim = read_host_limits(v1)
    assert lim.cgroup_limit == 2 * GiB and lim.cgroup_used == GiB - 128 * MiB
    assert lim.node_room == GiB + 128 * MiB and "hierarchical_memory_limit" in lim.binding
    # v1's "no limit" (the largest page counter) is no limit: MemAvailable binds.
    unlimited = fake_host(tmp_path / "v1u", total=64 * GiB, available=40 * GiB, cgroup="4:memory:/",
                          v1={"": {"memory.limit_in_bytes": "9223372036854771712",
                                   "memory.usage_in_bytes": str(GiB)}})
    lim = read_host_limits(unlimited, ranks_per_node=8)
    assert lim.cgroup is None and lim.binding == "MemAvailable" and lim.share == 5 * GiB
    assert "no cgroup memory limit" in lim.describe() and "8 ranks" in lim.describe()


def test_rlimit_memlock_lowered_in_a_subprocess_is_read_but_does_not_bind_cuda_pinning(tmp_path):
    """NVIDIA's driver pins with pin_user_pages and never charges locked_vm, which is what
    RLIMIT_MEMLOCK bounds (host_limits' module doc): lowering it leaves the budget as it was.
    Were it to bind (``memlock_binds``), the budget would follow it, per process."""
    paths = fake_host(tmp_path / "h", total=64 * GiB, available=8 * GiB, vmlck=16 * KiB)
    code = f"""
import json, resource
from protrain.runtime.host_limits import HostPaths, read_host_limits
from pathlib import Path
resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))
p = HostPaths(**{{k: Path(v) for k, v in {json.dumps({k: str(getattr(paths, k)) for k in HostPaths.__slots__})}.items()}})
a = read_host_limits(p, ranks_per_node=2)
b = read_host_limits(p, ranks_per_node=2, memlock_binds=True)
print(json.dumps([a.memlock, a.share, a.binding, b.share, b.binding]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    memlock, share, binding, bound_share, bound_binding = json.loads(out.strip().splitlines()[-1])
    assert memlock == 64 * KiB
    assert (share, binding) == (read_host_limits(paths, ranks_per_node=2).share, "MemAvailable")
    assert share == 4 * GiB
    # Per process: each rank may lock its own 64 KiB less what it has locked (VmLck 16 KiB).
    assert (bound_share, bound_binding) == (64 * KiB - 16 * KiB, "RLIMIT_MEMLOCK")


def test_pinning_beyond_the_limits_is_refused_before_the_allocation(tmp_path, monkeypatch):
    small = fake_host(tmp_path / "s", total=64 * MiB, available=8 * MiB)
    monkeypatch.setattr(host_limits, "SYSTEM", small)
    streams = Streams(torch.device("cpu"))
    ok = streams.pinned(1024, torch.float32, "a small buffer")     # 4 KiB: fits
    assert ok.numel() == 1024
    tried = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: tried.append(a) or real_empty(*a, **k))
    with pytest.raises(PinnedMemoryError) as err:
        streams.pinned(2 * MiB, torch.float32, "chunk 3's fp32 master")      # 8 MiB
    assert tried == []             # refused before torch.empty was asked
    msg = str(err.value)
    headroom = min(host_limits.GUARD_HEADROOM, 64 * MiB // 64)
    assert "chunk 3's fp32 master" in msg and fmt_bytes(8 * MiB) in msg
    assert f"{fmt_bytes(8 * MiB - headroom)} is left" in msg and "MemAvailable" in msg
    assert "protrain.ssd_path" in msg and "protrain.host_memory" in msg
    monkeypatch.setattr(torch, "empty", real_empty)
    # The allocator's own failure (256 TiB: past the address space) is named the same way.
    monkeypatch.setattr(host_limits, "SYSTEM", fake_host(tmp_path / "big", total=2**62, available=2**61))
    with pytest.raises(PinnedMemoryError, match="could not pin 256.0 TiB of host memory for a huge arena"):
        streams.pinned(2**46, torch.float32, "a huge arena")
    # and the whole plan's host memory, checked before the runtime takes any of it
    with pytest.raises(PinnedMemoryError, match="the plan's host memory"):
        check_pinning(2**62, "the plan's host memory", limits=read_host_limits(small))


def test_a_deepspeed_plan_beyond_the_hosts_limits_is_refused_naming_the_numbers(tmp_path, monkeypatch, capsys):
    """The budget the search gets is this rank's real share less host_reserve; a plan that
    needs more than the share (a host_memory set too high) is refused at the first forward,
    before the runtime pins anything; with no host_memory the search itself finds no plan and
    says where its budget came from."""
    from dstrain import UNTIED, base_config, train, with_protrain

    from protrain.measure.probe import probe_hardware
    from protrain.search import InfeasibleError
    from protrain.session.host_budget import admit, default_budget
    probe_hardware(torch.device("cpu"), progress=False)    # cached: measured under the real limits
    offloaded = dict(chunk_size="230KiB", n_persist=0, n_buffer=2, n_swap=0, n_checkpoint=0)
    job = {"memory.max": str(3 * GiB), "memory.current": str(GiB), "memory.stat": f"inactive_file {256 * MiB}"}
    roomy = fake_host(tmp_path / "roomy", total=64 * GiB, available=40 * GiB, cgroup="0::/job", v2={"job": job})
    monkeypatch.setattr(host_limits, "SYSTEM", roomy)
    # (ssd_path does not change the budget, only what the search may do under it; its probe
    # costs 20 s here)
    _, _, engine = train(with_protrain(base_config(), **offloaded), UNTIED, steps=1)
    plan, planner = engine.protrain_plan, engine.protrain_config.planner
    engine.destroy()
    limits = read_host_limits(roomy)
    # The share less what the pinning guard keeps free (256 MiB: more than the 10% reserve).
    assert plan.host_memory == default_budget(limits, planner.host_reserve) == \
        3 * GiB - 768 * MiB - host_limits.GUARD_HEADROOM
    need = plan.prediction.host_bytes
    assert need > MiB

    # The tiers of admission, on this plan: fits; leaves less than the reserve; beyond the share.
    # (A node of 256 KiB for the guard's headroom, 4 KiB: on a real one it keeps more free than
    # the reserve, and the warning tier is never reached.)
    def at(share):
        return replace(limits, mem_available=share, mem_total=256 * KiB, cgroup=None, cgroup_limit=None)
    assert admit(plan, at(2 * need), planner, ssd_path=None) is None
    warning = admit(plan, at(need + need // 20), planner, ssd_path=None)
    assert warning.startswith("ProTrain: warning") and fmt_bytes(need) in warning and "OOM killer" in warning
    with pytest.raises(InfeasibleError, match="cannot hold the plan"):
        admit(plan, at(need - 1), planner, ssd_path=None)

    # A host of less than the plan needs: MemAvailable binds.
    tight = fake_host(tmp_path / "tight", total=64 * MiB, available=need // 2)
    monkeypatch.setattr(host_limits, "SYSTEM", tight)
    share = read_host_limits(tight).share
    budget = default_budget(read_host_limits(tight), 0.1)
    def first_step(ds_config):
        import deepspeed
        from protrain.models import GPT, synthetic_batch
        model = GPT(UNTIED)
        engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
        try:
            engine.backward(engine(*synthetic_batch(UNTIED, ds_config["train_micro_batch_size_per_gpu"])))
        finally:
            engine.destroy()

    with pytest.raises(InfeasibleError) as err:      # host_memory set above what the host has
        first_step(with_protrain(base_config(), **offloaded, host_memory="1GiB"))
    msg = str(err.value)
    assert err.value.host_needed == need
    for words in (f"it needs {fmt_bytes(need)}", f"this rank can have {fmt_bytes(share)}",
                  f"MemAvailable binds at {fmt_bytes(share)}", "RLIMIT_MEMLOCK",
                  f"set protrain.host_memory to at most {fmt_bytes(budget)}",
                  "set protrain.ssd_path"):
        assert words in msg, (words, msg)
    with pytest.raises(InfeasibleError) as err:      # the default budget: the search says why
        first_step(with_protrain(base_config(), **offloaded))
    assert "cannot hold the plan" not in str(err.value)
    assert f"host budget {fmt_bytes(budget)}: this rank's {fmt_bytes(share)} less " in str(err.value), \
        str(err.value)


class _FailingRegistration(Streams):
    """Registers host memory as on CUDA (recorded, on any device), and fails the registration
    ``fails(t, n)`` picks (``n``: registrations so far) as cudaHostRegister does."""

    def __init__(self, device, fails):
        super().__init__(device)
        self.fails, self.calls, self.held, self.most = fails, 0, {}, 0

    def _register(self, t):
        self.calls += 1
        if self.fails(t, self.calls):
            raise RuntimeError("CUDA error: out of memory")        # torch.cuda.CudaError is one
        self.held[t.data_ptr()] = t.numel() * t.element_size()
        self.most = max(self.most, len(self.held))
        return True

    def _unregister(self, t):
        del self.held[t.data_ptr()]


@pytest.mark.parametrize("fails, what", [
    (lambda t, n: n == 1, r"chunk \d+'s parameters"),                 # the first chunk's
    (lambda t, n: n == 6, r"chunk \d+'s fp32 gradients"),             # a later chunk's
    (lambda t, n: t.dtype == torch.uint8, r"block \d+'s swapped activations"),  # after every chunk
], ids=["first-chunk", "later-chunk", "swap-arena"])
def test_a_pinning_failure_part_way_gives_the_model_back_as_it_was(fails, what, monkeypatch):
    """Issue 35, item 10: pinning fails part way through building the runtime. The error names
    what could not be pinned and what to do; the parameters are tensors of their own again
    (none a view of a chunk), on their device, with their values: the model runs without the
    engine; nothing stays registered."""
    import deepspeed
    from dstrain import UNTIED, base_config, with_protrain

    import protrain.runtime.runtime as rt_mod
    from protrain.models import GPT, synthetic_batch
    made = []

    def factory(device):
        made.append(_FailingRegistration(device, fails))
        return made[-1]
    monkeypatch.setattr(rt_mod, "Streams", factory)
    torch.manual_seed(0)
    model = GPT(UNTIED)
    x, y = synthetic_batch(UNTIED, 2)
    with torch.no_grad():
        want = model(x, y)
    before = {n: (p.device, p.detach().clone()) for n, p in model.named_parameters()}
    cfg = with_protrain(base_config(), chunk_size="110KiB", n_persist=2, n_buffer=4, n_swap=1,
                        n_checkpoint=1)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    try:
        with pytest.raises(PinnedMemoryError) as err:
            engine(*synthetic_batch(UNTIED, 2, device=engine.device))
    finally:
        engine.destroy()
    msg = str(err.value)
    assert re.search(r"could not pin .* of host memory for " + what, msg), msg
    assert "CUDA error: out of memory" in msg and "protrain.host_memory" in msg
    assert len(made) == 1 and made[0].most == made[0].calls - 1      # all pinned before it
    assert made[0].held == {} and made[0].pinned_bytes() == 0       # ... and given back
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(storages)) == len(storages)                      # no parameter in a chunk
    for n, p in model.named_parameters():
        assert p.device == before[n][0] and torch.equal(p.detach(), before[n][1]), n
    loss = model(x, y)
    assert torch.equal(loss.detach(), want)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.gpu
def test_a_failed_cuda_host_register_leaves_no_error_for_the_next_kernel():
    """A failed cudaHostRegister is also left as the thread's last CUDA error, which the next
    kernel launch's check would report as its own (issue 35, item 10): cleared."""
    streams = Streams(torch.device("cuda"))
    t = streams.pinned(2**20, torch.uint8, "a region")
    with pytest.raises(RuntimeError):
        streams._register(t)              # the same pages again: cudaHostRegister refuses
    x = torch.ones(8, device="cuda") * 2  # its launch check must not see that failure
    assert x.sum().item() == 16
    streams.release_pinned()
    assert streams.pinned_bytes() == 0


def _speculating_small(host, drive: bool):
    from test_search import SMALL, SSD as DRIVES, small_hw

    from protrain.config import PlannerConfig
    from protrain.profile.analytic import analytic_profile
    hw = small_hw(device_memory=60 * MiB, host_memory=host, **(DRIVES["gds"] if drive else {}))
    config = PlannerConfig(chunk_sizes=(1 * MiB,), cpu_optim_overlap=False, cpu_optim_speculative=True,
                           gradient_clipping=True, speculate_chunks=99)
    return analytic_profile(SMALL, hw), hw, config


def test_a_pinned_speculate_chunks_is_planned_within_the_host_budget():
    """Issue 38, item 10: the backups of a pinned speculate_chunks are host memory the plan
    holds. With a drive the search moves more chunks' states there (they speculate without a
    backup) until the plan fits; without one the refusal names the pin and its fix - not a
    plan printed as "host memory X of Y" with X > Y."""
    # The inner search: a tiled head frees enough device memory to keep more chunks there,
    # which is not what is tested.
    from protrain.search import InfeasibleError
    from protrain.search.loop import search
    prof, hw, config = _speculating_small(40 * MiB, drive=True)
    plan = search(prof, hw, config)
    assert plan.n_speculate == plan.chunks.n_chunks - plan.knobs.n_persist > 0 and plan.knobs.n_nvme > 0
    assert plan.prediction.host_bytes <= 40 * MiB
    row = next(line for line in plan.explain().splitlines() if "host memory" in line)
    assert f"host memory {fmt_bytes(plan.prediction.host_bytes)} of {fmt_bytes(40 * MiB)}" in row
    prof, hw, config = _speculating_small(60 * MiB, drive=False)
    assert search(prof, hw, replace(config, speculate_chunks=None)).prediction.host_bytes <= 60 * MiB
    with pytest.raises(InfeasibleError) as e:
        search(prof, hw, config)
    msg = str(e.value)
    assert "speculation backups" in msg and "speculate_chunks=99" in msg
    assert "Pin speculate_chunks lower, or leave it on auto" in msg and "60.0 MiB is available" in msg


def test_the_default_budget_is_what_the_runtime_may_pin_and_the_fixes_name_only_pinned_knobs(tmp_path):
    """Issue 38, item 10: on a host with 1 GiB available the pinning guard keeps 256 MiB free,
    more than the 10% host_reserve: the default budget leaves that much, so a plan inside it
    is pinned, not refused; a plan between what the guard allows and the share is refused at
    admission (not at the first pinned allocation) with fixes that can help: "unpin n_nvme"
    only where it was pinned, the pinned speculate_chunks where it was."""
    from protrain.config import KnobPins
    from protrain.search import InfeasibleError, search
    from protrain.session.host_budget import admit, default_budget, describe_budget
    limits = read_host_limits(fake_host(tmp_path / "h", total=64 * GiB, available=GiB))
    prof, hw, config = _speculating_small(40 * MiB, drive=True)
    budget = default_budget(limits, config.host_reserve)
    check_pinning(budget, "a plan at the default budget", limits=limits)       # not refused
    assert budget == GiB - host_limits.GUARD_HEADROOM == limits.pinnable < int(0.9 * GiB)
    assert "the 256.0 MiB the pinning guard keeps free" in describe_budget(limits, config)
    plan = search(prof, hw, config)
    big = replace(plan, prediction=replace(plan.prediction, host_bytes=budget + MiB))
    with pytest.raises(InfeasibleError) as e:
        admit(big, limits, config, ssd_path=str(tmp_path))
    msg = str(e.value)
    assert f"this rank can have {fmt_bytes(GiB)} less the 256.0 MiB the pinning guard keeps free" in msg
    assert "unpin n_nvme" not in msg and "pin speculate_chunks lower" in msg
    pinned = replace(config, pins=KnobPins(n_nvme=3), speculate_chunks=None)
    with pytest.raises(InfeasibleError, match=r"unpin n_nvme, pinned to 3"):
        admit(big, limits, pinned, ssd_path=str(tmp_path))


def test_protrain_host_memory_is_the_nodes_shared_by_its_ranks(tmp_path, capsys):
    """Issue 37, item 6: the runtime's budget with 4 ranks on a node. Without the key each rank
    plans for its share of what the node can give (less the reserve); ``protrain.host_memory``
    is the node's, as ``protrain plan --host-memory`` and the machine line: each rank plans
    for a quarter of it. The start-up line names the node's figure and the rank's; a key set
    above what the node can give is refused naming both, with the node's figure to set."""
    from protrain.config import PlannerConfig
    from protrain.runtime.collectives import DataParallel
    from protrain.search import InfeasibleError, search
    from protrain.session.host_budget import default_budget
    from protrain.session.ranks import PlanRanks
    from protrain.session.session import PlanningSession, PlanningSteps
    prof, hw, _ = _speculating_small(GiB, drive=False)
    hw = replace(hw, ranks_per_node=4)
    limits = read_host_limits(fake_host(tmp_path / "h", total=64 * GiB, available=32 * GiB), ranks_per_node=4)
    assert limits.share == 8 * GiB
    steps = PlanningSteps(load=lambda planner, target: None, measure=lambda batch: prof,
                          machine=lambda: hw, search=lambda p, h, c, t: search(p, h, c),
                          word=lambda failure: failure.own, host=lambda: limits)

    def first(config):
        return PlanningSession(PlanRanks(DataParallel()), steps, plan_file=None).first_plan(
            config, None, None, verbosity=1, probe=lambda: None)
    config = PlannerConfig(chunk_sizes=(1 * MiB,))
    plan = first(config)
    budget = default_budget(limits, config.host_reserve)
    assert plan.host_memory == budget == int(8 * GiB * 0.9) and plan.node_host_memory == 4 * budget
    out = capsys.readouterr().out
    assert (f"host budget {fmt_bytes(budget)} per rank ({fmt_bytes(4 * budget)} for the node's 4 ranks): "
            f"this rank's 8.0 GiB less the 10% host_reserve") in out, out
    assert f"of {fmt_bytes(budget)} per rank (the node's {fmt_bytes(4 * budget)} / 4 ranks)" in out

    plan = first(replace(config, host_memory=20 * GiB))           # the node's 20 GiB: 5 GiB each
    assert plan.host_memory == 5 * GiB and plan.node_host_memory == 20 * GiB
    assert plan.prediction.host_bytes <= 5 * GiB
    out = capsys.readouterr().out
    assert ("host budget 20.0 GiB for the node (protrain.host_memory): 5.0 GiB for each of the "
            "node's 4 ranks; this rank can have 8.0 GiB") in out, out

    # The node's 64 GiB: 16 GiB a rank, more than the 8 GiB each can have. A plan that takes
    # more than its share is refused before anything is pinned.
    big = replace(plan, prediction=replace(plan.prediction, host_bytes=9 * GiB))
    with pytest.raises(InfeasibleError) as e:
        PlanningSession(PlanRanks(DataParallel()), replace(steps, search=lambda p, h, c, t: big),
                        plan_file=None).decide(replace(config, host_memory=64 * GiB), None)
    msg = str(e.value)
    for words in ("this rank can have 8.0 GiB", "this rank's share (4 ranks on the node) 8.0 GiB",
                  f"set protrain.host_memory to at most {fmt_bytes(4 * budget)} (the node's host "
                  f"memory, {fmt_bytes(budget)} for each of its 4 ranks; it is 64.0 GiB, 16.0 GiB each)"):
        assert words in msg, (words, msg)
