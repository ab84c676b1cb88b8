"""Optimizer states on the drive (issue 27): the cost model prices them and the search chooses
n_nvme - the fewest chunks whose states leave the host that fit it, none where the host is
ample; a pin is honoured and priced; a drive too small is refused naming its free space; the
drive's bandwidth is shared by the activations and the states (and by a node's ranks)."""
from __future__ import annotations

from dataclasses import replace

import re

import numpy as np
import pytest

from protrain.block_mode import NONE, SSD
from protrain.cli import main
from protrain.config import KnobPins, PlannerConfig
from protrain.cost.memory import nvme_file_top, nvme_state_top, state_bytes
from protrain.cost.time_model import simulate
from protrain.layout import build_layout
from protrain.profile.analytic import PRESETS, analytic_profile
from protrain.profile.machines import machine
from protrain.search import InfeasibleError
# The inner search (the head's tile is chosen around it: tests/test_tiled_head.py).
from protrain.search.loop import search
from protrain.state_tier import FIELD_ALIGN, NVME_STATE_SLOTS, STAGING_SLOTS
from protrain.units import GiB, MiB, fmt_bytes
from conftest import chain_profile, slow_link
from test_search import SMALL, SSD as DRIVES, brute_force, small_hw

ACCEPTANCE = ["plan", "--model", "llama2-70b", "--micro-batch", "1", "--seq", "4096", "--gpu", "h100-80gb",
              "--host-memory", "256GiB", "--nvme", "12", "--nvme-free", "4TiB"]


def test_llama2_70b_plans_within_the_host_with_states_on_the_drive(capsys):
    """The issue's command: 854 GiB of states, 256 GiB of host: most chunks' states on the drive,
    the host bytes within the budget, the step time and the drive's bytes printed."""
    assert main(ACCEPTANCE) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("n_nvme"))
    assert "offloaded chunks on NVMe" in row and "read + written per step" in row
    assert "of 256.0 GiB" in out and "predicted: iteration" in out
    hw = replace(machine("h100-80gb").profile(host_memory=256 * GiB), nvme_write_bandwidth=12e9,
                 nvme_read_bandwidth=12e9, nvme_free_bytes=4 << 40)
    prof = analytic_profile(replace(PRESETS["llama2-70b"], micro_batch=1, seq_len=4096), hw)
    plan = search(prof, hw, PlannerConfig(cpu_optim_overlap=False, cpu_optim_speculative=True,
                                          gradient_clipping=True))
    p, k = plan.prediction, plan.knobs
    assert 0 < k.n_nvme <= plan.chunks.n_chunks - k.n_persist and p.host_bytes <= 256 * GiB
    layout = build_layout(prof, k.chunk_size // 2)
    states = int(nvme_state_top(layout, state_bytes(2), 1)[k.n_nvme])
    assert p.nvme_state_io_bytes == 2 * states
    # the drive space is the state file as the runtime lays it out: both places, padded fields
    assert p.nvme_state_bytes == nvme_file_top(layout, state_bytes(2), 1)[k.n_nvme] >= NVME_STATE_SLOTS * states
    # the fewest that fit: one chunk fewer on the drive would not fit the host
    fewer = int(nvme_state_top(layout, state_bytes(2), 1)[k.n_nvme - 1])
    assert p.host_bytes - p.staging_bytes * (k.n_nvme == 1) + states - fewer > 256 * GiB


def test_a_drive_too_small_is_refused_naming_its_free_space(capsys):
    assert main(ACCEPTANCE[:-1] + ["100GiB"]) == 3
    err = capsys.readouterr().err
    assert "100.0 GiB free" in err and "--nvme-free" in err and "ssd_path" in err
    # without a drive, the host's refusal says how to use one
    assert main(ACCEPTANCE[:-4]) == 3
    assert "set ssd_path" in capsys.readouterr().err


def _small(host, **pins):
    hw = small_hw(device_memory=60 * MiB, host_memory=host, **DRIVES["gds"])
    prof = analytic_profile(SMALL, hw)
    return prof, hw, PlannerConfig(chunk_sizes=(1 * MiB, 2 * MiB), pins=KnobPins(**pins))


def test_search_with_states_on_the_drive_equals_brute_force():
    """A host too small for the states: the search's n_nvme (the fewest that fit, per point) is
    the brute force's over every n_nvme of every point."""
    prof, hw, config = _small(30 * MiB)
    with pytest.raises(InfeasibleError, match="set ssd_path"):
        search(prof, replace(hw, nvme_write_bandwidth=0.0, nvme_read_bandwidth=0.0), config)
    plan = search(prof, hw, config)
    ref = brute_force(prof, hw, config, states_on_drive=True)
    got = (plan.prediction.step_time, plan.prediction.peak_device_bytes,
           plan.knobs.as_tuple() + (plan.knobs.n_nvme,))
    assert got[1:] == ref[1:] and got[0] == pytest.approx(ref[0], rel=1e-12)
    assert plan.knobs.n_nvme > 0 and plan.prediction.host_bytes <= 30 * MiB


def test_ample_host_keeps_states_on_host_and_a_pin_is_honoured_and_priced():
    prof, hw, config = _small(1 * GiB)
    free = search(prof, hw, config)
    assert free.knobs.n_nvme == 0 and free.prediction.nvme_state_bytes == 0
    pinned = search(prof, hw, replace(config, pins=KnobPins(n_nvme=2)))
    assert pinned.knobs.n_nvme == 2 and "n_nvme" in pinned.pinned
    assert pinned.prediction.step_time >= free.prediction.step_time
    assert pinned.prediction.nvme_state_io_bytes > 0
    assert re.search(r"n_nvme +2 \(pinned\) +states of 2/", pinned.explain())
    # the same knobs on the host: the drive only adds time, and takes states off the host
    same = search(prof, hw, replace(config, pins=KnobPins(**{
        k: getattr(pinned.knobs, k) for k in ("chunk_size", "n_persist", "n_buffer", "n_swap",
                                                "n_checkpoint", "n_ssd", "n_selective")}, n_nvme=0)))
    assert pinned.prediction.iter_time >= same.prediction.iter_time
    p, q = pinned.prediction, same.prediction
    assert p.host_bytes == q.host_bytes - p.nvme_state_io_bytes // 2 + p.staging_bytes
    # the ring as the runtime allocates it: each buffer a chunk's states, 4 KiB more to align
    assert p.staging_bytes == STAGING_SLOTS * (12 * (1 * MiB // 2) + FIELD_ALIGN)
    with pytest.raises(InfeasibleError, match="no drive is configured"):
        search(prof, replace(hw, nvme_write_bandwidth=0.0), replace(config, pins=KnobPins(n_nvme=1)))
    # more than the offloaded chunks: the most there can be named, with the fix
    most = max(build_layout(prof, c).n_chunks - build_layout(prof, c).min_persist
               for c in (s // prof.param_bytes for s in config.chunk_sizes))
    with pytest.raises(InfeasibleError, match=rf"pinned n_nvme={most + 1} exceeds the offloaded "
                       rf"chunks.*at most {most} can be offloaded.*Pin n_nvme between 0 and {most}"):
        search(prof, hw, replace(config, pins=KnobPins(n_nvme=most + 1)))
    assert search(prof, hw, replace(config, pins=KnobPins(n_nvme=most))).knobs.n_nvme == most


def test_eight_ranks_per_node_share_the_drive():
    """llama2-7b over 8 ranks of one node whose host holds too little: states go to the drive,
    whose bandwidth and space the 8 ranks share (more drive time per rank than one rank alone).
    The node's 16 GiB of host memory: 2 GiB for each rank."""
    hw = replace(machine("h100-80gb").profile(host_memory=16 * GiB), nvme_write_bandwidth=12e9,
                 nvme_read_bandwidth=12e9, nvme_free_bytes=1 << 40, ranks_per_node=8)
    prof = analytic_profile(replace(PRESETS["llama2-7b"], micro_batch=1, seq_len=4096), hw)
    config = PlannerConfig(data_parallel_size=8, cpu_optim_overlap=False, cpu_optim_speculative=True,
                           gradient_clipping=True)
    # Sharded over the 8 devices the whole model's states fit them (1/8 each): no drive.
    sharded = search(prof, hw, config).knobs
    assert sharded.n_persist == build_layout(prof, sharded.chunk_size // 2).n_chunks
    assert sharded.n_shard > 0 and sharded.n_nvme == 0
    # Each device keeping whole chunks only, the host is too small: states go to the drive.
    config = replace(config, pins=KnobPins(n_shard=0))
    plan = search(prof, hw, config)
    assert plan.knobs.n_nvme > 0 and plan.prediction.host_bytes <= 2 * GiB
    assert 8 * plan.prediction.nvme_state_bytes <= hw.nvme_free_bytes
    layout = build_layout(prof, plan.knobs.chunk_size // 2)
    codes = np.zeros((1, prof.n_blocks), dtype=np.int8)
    drive = {r: float(simulate(prof, layout, replace(hw, ranks_per_node=r), plan.knobs.n_persist,
                               plan.knobs.n_buffer, codes, world=8, n_nvme=plan.knobs.n_nvme).drive_time[0])
             for r in (1, 8)}
    assert drive[8] == pytest.approx(8 * drive[1])
    with pytest.raises(InfeasibleError, match="1.0 GiB free, shared by 8 ranks per node: 128.0 MiB each"):
        search(prof, replace(hw, nvme_free_bytes=1 * GiB), config)


def test_activations_and_states_share_the_drive():
    """SSD blocks' activations and NVMe chunks' states add up on the drive: a plan with both is
    busier there than with either alone, and a drive-bound step takes the longer for it."""
    prof = chain_profile(saved=800)
    layout = build_layout(prof, 100)
    hw = slow_link(nvme_write_bandwidth=80.0, nvme_read_bandwidth=80.0, nvme_gds=True)
    t = {(ssd, nv): simulate(prof, layout, hw, 1, 1, np.array([[SSD if ssd else NONE, NONE]]), n_nvme=nv)
         for ssd in (False, True) for nv in (0, 1)}
    both, acts, states = t[True, 1], t[True, 0], t[False, 1]
    assert both.drive_time[0] > acts.drive_time[0] > 0 and both.drive_time[0] > states.drive_time[0] > 0
    assert both.drive_time[0] == pytest.approx(max(acts.drive_time[0] + states.drive_time[0],
                                                   states.drive_time[0]))
    assert both.iter_time[0] >= max(acts.iter_time[0], states.iter_time[0])


def test_fp32_with_speculation_stages_and_writes_the_master_too():
    """fp32: the parameters are the master and stay in host memory (8 bytes per element leave
    it); with speculation the staging buffers, the drive's places and the write-backs carry
    the master from before the update as well (12), as runtime.nvme_states lays them out."""
    hw = small_hw(device_memory=60 * MiB, host_memory=1 * GiB, **DRIVES["gds"])
    prof = analytic_profile(replace(SMALL, dtype_bytes=4), hw)
    base = PlannerConfig(chunk_sizes=(2 * MiB,), pins=KnobPins(n_nvme=2))
    plain = search(prof, hw, base).prediction
    spec = search(prof, hw, replace(base, cpu_optim_overlap=False, cpu_optim_speculative=True,
                                    gradient_clipping=True)).prediction
    numel = 2 * MiB // 4
    assert plain.staging_bytes == STAGING_SLOTS * (8 * numel + FIELD_ALIGN)
    assert spec.staging_bytes == STAGING_SLOTS * (12 * numel + FIELD_ALIGN)
    read = plain.nvme_state_io_bytes // 2
    assert spec.nvme_state_bytes == plain.nvme_state_bytes * 12 // 8
    assert spec.nvme_state_io_bytes == read + read * 12 // 8


def test_the_plan_prices_the_state_file_the_runtime_lays_out(tmp_path):
    """Issue 38, item 5: fp32 with clipping, the last chunk smaller than the others. The runtime
    pads every chunk's fields to the largest shard's stride (4 KiB-aligned), keeps two places
    per chunk and three fields (the master from before a speculative update): the plan's drive
    bytes are that file's size, to the byte, so a plan chosen for a drive fits it; the staging
    ring it counts in host memory is at least the runtime's."""
    from types import SimpleNamespace

    import torch

    from protrain.runtime.nvme_states import NvmeStates
    from protrain.runtime.storage import ALIGN
    from protrain.runtime.streams import Streams
    hw = small_hw(device_memory=60 * MiB, host_memory=1 * GiB, **DRIVES["gds"])
    prof = analytic_profile(replace(SMALL, dtype_bytes=4), hw)
    config = PlannerConfig(chunk_sizes=(2 * MiB,), pins=KnobPins(n_nvme=3), cpu_optim_overlap=False,
                           cpu_optim_speculative=True, gradient_clipping=True)
    plan = search(prof, hw, config)
    layout = build_layout(prof, plan.knobs.chunk_size // 4)
    ids = range(layout.n_chunks - 3, layout.n_chunks)
    assert len({layout.used[i] for i in ids}) > 1          # padding matters here
    states = NvmeStates(ids, tmp_path, Streams(torch.device("cpu")), torch.device("cpu"), speculative=True)
    states.open([SimpleNamespace(index=i, shard_size=layout.used[i]) for i in ids], master_separate=False)
    try:
        assert states.file_bytes() == plan.prediction.nvme_state_bytes
        assert states.staging_bytes() <= plan.prediction.staging_bytes
    finally:
        states.close()
    assert FIELD_ALIGN == ALIGN       # state_tier lays the file out with the storage's alignment
    # A drive that holds the file but not the margin (it held the unpadded states' with it):
    # refused by the planner, not when the runtime is built.
    with pytest.raises(InfeasibleError, match="on the drive per rank"):
        search(prof, replace(hw, nvme_free_bytes=plan.prediction.nvme_state_bytes), config)


def test_pinned_knobs_that_run_out_of_drive_name_the_drive_not_the_pins(monkeypatch):
    """Issue 38, item 6: with pins, the drive binds (the plan without them keeps every state in
    host memory): the refusal says so, with the drive's numbers and fix, before the plan
    without the pins."""
    hw = small_hw(device_memory=100 * MiB, host_memory=30 * MiB, **DRIVES["gds"])
    prof = analytic_profile(SMALL, hw)
    config = PlannerConfig(chunk_sizes=(1 * MiB,), pins=KnobPins(n_persist=2))
    plan = search(prof, hw, config)
    assert plan.knobs.n_nvme > 0
    small = replace(hw, nvme_free_bytes=plan.prediction.nvme_state_bytes // 2)
    import protrain.search.loop as loop
    searched = []
    real = loop.search
    monkeypatch.setattr(loop, "search", lambda *a, **k: searched.append(a[2].pins) or real(*a, **k))
    with pytest.raises(InfeasibleError) as e:
        loop.search(prof, small, config)
    # The plan without the pins is searched only when the message is read (the searches
    # around this one try variants whose errors are never shown), and once.
    assert len(searched) == 1
    msg = str(e.value)
    assert len(searched) == 2 and searched[1].n_persist is None and str(e.value) == msg and len(searched) == 2
    assert msg.startswith("no plan fits with the pinned knobs {'n_persist': 2}: the plan that needs "
                          "the least drive puts"), msg
    assert f"the SSD path has {fmt_bytes(small.nvme_free_bytes)} free" in msg and "Free space under ssd_path" in msg
    assert "Without the pins the planner finds" in msg and "n_nvme=0" in msg


def test_a_replan_prices_the_drive_as_it_is_now_naming_the_state_file_it_still_holds():
    """Issue 38, item 6: a re-plan (a longer batch, after a resume) is built while the old
    runtime's state file is still on the drive. The session asks the drive for its free space
    at every decision (the machine's figure was measured before any file existed) and the
    refusal names the drive, the file it still holds and a fix that avoids the re-plan."""
    from protrain.runtime.collectives import DataParallel
    from protrain.session.ranks import PlanRanks
    from protrain.session.session import PlanningSession, PlanningSteps
    hw = small_hw(device_memory=100 * MiB, host_memory=30 * MiB, **DRIVES["gds"])
    prof = analytic_profile(SMALL, hw)
    config = PlannerConfig(chunk_sizes=(1 * MiB,), pins=KnobPins(n_persist=2))
    drive = {"free": 10 * GiB}
    steps = PlanningSteps(load=lambda planner, target: None, measure=lambda batch: prof,
                          machine=lambda: hw, search=lambda p, h, c, t: search(p, h, c),
                          word=lambda failure: failure.own, drive_free=lambda: drive["free"])
    session = PlanningSession(PlanRanks(DataParallel()), steps, plan_file=None)
    first = session.decide(config, None).plan
    held = first.prediction.nvme_state_bytes
    assert first.knobs.n_nvme > 0
    # Room for one state file, with the margin: the old one takes it until its states moved.
    drive["free"] = int(1.5 * held) - held
    with pytest.raises(InfeasibleError) as e:
        session.replan(config, None, old=first, keep_grads=False, drive_held=held)
    msg = str(e.value)
    for words in ("no plan fits with the pinned knobs", f"has {fmt_bytes(drive['free'])} free while this "
                  f"run's current state file ({fmt_bytes(held)} per rank) is on it", "room for both",
                  "protrain.max_seq_len"):
        assert words in msg, (words, msg)
    drive["free"] = 10 * GiB
    assert session.replan(config, None, old=first, keep_grads=False, drive_held=held).knobs == first.knobs
