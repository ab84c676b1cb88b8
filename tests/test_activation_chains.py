"""Bounds from the activations' copy chains (``bounds.activation_chains``) and the verdict
bound's last chunk in host memory (``SpeculatingIterationBound._last_in_host``): each below
what the step-time model simulates, and the fast forms equal to the slow ones."""
from dataclasses import replace

import numpy as np
import pytest

from protrain.block_mode import CKPT, CKPT_HOST, CKPT_SSD
from protrain.config import KnobPins, PlannerConfig
from protrain.cost.time_model import simulate
from protrain.profile.analytic import PRESETS, ModelShape, analytic_profile
from protrain.profile.machines import machine
from protrain.search import bounds, evaluation, space
from protrain.units import GiB

SMALL = ModelShape("small", "gpt2", n_layers=6, hidden=256, heads=4, vocab=2048, seq_len=256,
                   micro_batch=8, max_positions=256)
DRIVES = {
    "gds": dict(nvme_write_bandwidth=3e9, nvme_read_bandwidth=5e9, nvme_gds=True, nvme_free_bytes=10 * GiB),
    "compat": dict(nvme_write_bandwidth=2e9, nvme_read_bandwidth=3e9, nvme_gds=False, nvme_free_bytes=10 * GiB),
}


def _hw(drive: str, **over):
    return replace(machine("rtx3090").profile(host_memory=4 * GiB), **DRIVES[drive], **over)


@pytest.mark.parametrize("drive", ["gds", "compat"])
@pytest.mark.parametrize("where", ["device", "host", "drive"])
@pytest.mark.parametrize("engines", [2, 1, 0])
def test_chains_equal_the_exact_recurrence_and_lie_below_the_simulation(drive, where, engines):
    """Every activation configuration's forward / backward chain (one chain per key in
    ``space._chains``) equals the recurrence run on its own layout with the checkpointed
    inputs on the device, and lies below the forward and backward the step-time model
    simulates for it - two copy engines, one, none (a CPU "device"); with the checkpointed
    inputs moved too. Some chain rises above the compute alone (else it would bound nothing)."""
    hw = _hw(drive, copy_engines=engines)
    prof = analytic_profile(SMALL, hw)
    config = PlannerConfig(pins=KnobPins(ckpt_input=where))
    acts = space.activation_configs(prof, config, hw)
    a = np.arange(len(acts.n_ckpt))
    codes = acts.codes(a)
    on_device = np.where(np.isin(codes, (CKPT_HOST, CKPT_SSD)), CKPT, codes).astype(np.int8)
    fwd, bwd = bounds.activation_chains(prof, hw, on_device)
    fwd_compute = sum(p.fwd_time for p in prof.parts)
    assert np.allclose(acts.fwd_write, fwd, rtol=1e-12, atol=0)
    assert np.allclose(acts.bwd_read, bwd, rtol=1e-12, atol=0)
    # Below the simulation, plan by plan (one layout, every configuration, all chunks offloaded).
    from protrain.layout import build_layout
    layout = build_layout(prof, 1 << 20)
    n = len(a)
    t = simulate(prof, layout, hw, np.zeros(n, dtype=np.int64), np.full(n, layout.n_chunks), codes,
                 cpu_overlap=True)
    assert (acts.fwd_write <= t.fwd_time * (1 + 1e-12)).all()
    assert (acts.bwd_read <= t.bwd_time * (1 + 1e-12)).all()
    assert (acts.fwd_write > fwd_compute * 1.01).any()
    assert (acts.bwd_read > sum(p.bwd_time for p in prof.parts) + acts.recompute + 1e-9).any()


def _llama(host, nvme=12e9, **shape):
    hw = replace(machine("h100-80gb").profile(host_memory=host), nvme_write_bandwidth=nvme,
                 nvme_read_bandwidth=nvme, nvme_gds=False, nvme_free_bytes=2**43)
    return hw, analytic_profile(replace(PRESETS["llama2-13b"], **shape), hw)


def test_the_grouped_table_equals_the_table_of_every_plan(monkeypatch):
    """``with_reads`` finds each plan's least over the counts by groups and bisection: the
    same value as the whole [plans, counts] table of the four chains."""
    hw, prof = _llama(160 * GiB, micro_batch=4, seq_len=4096)
    config = PlannerConfig(cpu_optim_overlap=False, cpu_optim_speculative=True, gradient_clipping=True)
    budget = hw.device_memory / (1 + config.memory_margin)
    acts = space.activation_configs(prof, config, hw)
    seen = 0
    for cap in space.candidate_capacities(prof, config)[:2]:
        grid = space.candidate_grid(prof, hw, config, acts, cap, budget, {})
        idx = np.flatnonzero(grid.n_nvme > 0)[:3000]
        if not len(idx):
            continue
        calls = []
        original = bounds.SpeculatingIterationBound.with_reads

        def both(self, s_max, t_read, t_write, *, shared, pinned):
            calls.append((_table(self, s_max, t_read, t_write, shared, pinned),
                          original(self, s_max, t_read, t_write, shared=shared, pinned=pinned)))
            return calls[-1][1]
        monkeypatch.setattr(bounds.SpeculatingIterationBound, "with_reads", both)
        bounds.refine_speculating_reads(prof, hw, config, grid, idx)
        monkeypatch.setattr(bounds.SpeculatingIterationBound, "with_reads", original)
        for want, got in calls:
            assert np.allclose(got, want, rtol=1e-12, atol=0)
            seen += len(got)
    assert seen > 100


def _table(sb, s_max, t_read, t_write, shared, pinned):
    """The [plans, counts] table: every term at every count, the least per plan."""
    plans = len(sb.n_off)
    s_max = np.broadcast_to(np.asarray(s_max), (plans,))
    s = np.arange(min(int(s_max.max(initial=0)), len(sb.adam_top) - 1) + 1)[None, :]
    n_off, nv = sb.n_off[:, None], sb.n_nvme[:, None]
    backward = np.broadcast_to(sb.backward, (plans,))[:, None]
    adam = sb.adam[:, None]
    after = np.where(s < n_off, backward + adam - sb.adam_top[s] + sb.up_next[s], backward)
    backups = sb.backup_top[s] - sb.backup_top[np.minimum(s, nv)]
    uploads = np.where(sb._offloading[:, None], sb.up_next[np.minimum(s, sb._last[:, None])], 0.0)
    chain = sb._base[:, None] + backups + uploads
    top = lambda t: np.concatenate([[0.0], np.cumsum(t[::-1])])    # noqa: E731
    k = np.minimum(s, nv)
    ready = sb.lead[:, None] + top(t_read)[k]
    if shared:
        ready = ready + top(t_write)[np.maximum(k - bounds.STAGING_SLOTS, 0)]
    drive = np.where(k > 0, ready + adam - sb.adam_top[np.maximum(k - 1, 0)] + backups + uploads, -np.inf)
    value = np.maximum(np.maximum(np.maximum(chain, after), drive), sb._last_in_host(s, n_off, nv, backward, adam))
    if pinned:
        return value[np.arange(plans), np.minimum(s_max, n_off[:, 0])]
    return np.where((s <= s_max[:, None]) & (s <= n_off), value, np.inf).min(axis=1)


def test_the_last_chunk_in_host_memory_bounds_plans_with_states_interleaved():
    """Plans whose states are partly on the drive: the CPU interleaves the drive's updates with
    those in host memory after backward, so the last of them is often the highest chunk in
    host memory, low in the next forward. The refined bound with it lies below the simulated
    step of every sampled point, and raises some bounds the other chains leave lower."""
    hw, prof = _llama(160 * GiB, micro_batch=4, seq_len=4096)
    config = PlannerConfig(cpu_optim_overlap=False, cpu_optim_speculative=True, gradient_clipping=True)
    budget = hw.device_memory / (1 + config.memory_margin)
    acts = space.activation_configs(prof, config, hw)
    raised = checked = 0
    original = bounds.SpeculatingIterationBound._last_in_host
    for cap in space.candidate_capacities(prof, config)[:2]:
        grid = space.candidate_grid(prof, hw, config, acts, cap, budget, {})
        idx = np.flatnonzero(grid.n_nvme > 0)
        idx = idx[::max(1, len(idx) // 120)][:120]
        if not len(idx):
            continue
        t = evaluation.simulate_points(prof, hw, config, acts, grid, idx)
        refined = bounds.refine_cpu_bound(prof, hw, config, acts, grid, idx)
        assert (refined <= t * (1 + 1e-12)).all()
        bounds.SpeculatingIterationBound._last_in_host = lambda self, s, *a: np.full(np.shape(s), -np.inf)
        try:
            without = bounds.refine_cpu_bound(prof, hw, config, acts, grid, idx)
        finally:
            bounds.SpeculatingIterationBound._last_in_host = original
        raised += int((refined > without * (1 + 1e-6)).sum())
        checked += len(idx)
    assert checked > 50 and raised > 0
