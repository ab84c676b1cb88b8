"""The planner's side of speculative CPU Adam (gradient clipping / fp16 loss scaling): how many
offloaded chunks speculate, what their backups cost in host memory, and what it buys."""
from dataclasses import replace

import numpy as np
import pytest

from protrain.config import KnobPins, PlannerConfig
from protrain.layout import build_layout
from protrain.profile.analytic import ModelShape, analytic_profile
from protrain.profile.machines import machine
from protrain.search import evaluate, search
from protrain.units import GiB, MiB

SHAPE = ModelShape("spec", "gpt2", n_layers=8, hidden=1024, heads=8, vocab=4096, seq_len=512,
                   micro_batch=8)
# A GPU whose step is bound by CPU Adam when it waits for the end of backward (and whose
# updates left for after it cannot all hide under the next forward).
HW = replace(machine("rtx3090").profile(host_memory=64 * GiB), cpu_adam_rate=5e8, grad_check_rate=3e9)
PINS = KnobPins(chunk_size=16 * MiB, n_persist=1, n_buffer=3, n_swap=0, n_checkpoint=8, n_ssd=0,
                n_selective=0)


def plans(**config):
    prof = analytic_profile(SHAPE, HW)
    base = PlannerConfig(pins=PINS, cpu_optim_overlap=False, **config)
    return prof, search(prof, HW, base), search(prof, HW, replace(base, cpu_optim_speculative=True))


def test_speculation_shortens_the_step_and_pays_its_backups_in_host_memory():
    prof, after, spec = plans()
    n_off = spec.chunks.n_chunks - spec.knobs.n_persist
    assert after.n_speculate == 0 and 0 < spec.n_speculate <= n_off
    assert spec.prediction.iter_time < after.prediction.iter_time
    assert spec.prediction.cpu_optim_exposed < after.prediction.cpu_optim_exposed
    # 12 bytes (master, exp_avg, exp_avg_sq) per parameter of the speculating chunks: the last ones
    layout = build_layout(prof, spec.knobs.chunk_size // prof.param_bytes)
    assert spec.prediction.host_bytes - after.prediction.host_bytes == \
        12 * int(np.sum(layout.used[layout.n_chunks - spec.n_speculate:]))
    assert "n_speculate" in spec.explain() and "n_speculate" not in after.explain()


def test_each_chunk_speculating_is_the_fastest_choice_the_sweep_saw():
    """The chosen count is at least as fast as every other count (each evaluated with a pin)."""
    prof, _, spec = plans()
    n_off = spec.chunks.n_chunks - spec.knobs.n_persist
    cfg = PlannerConfig(pins=PINS, cpu_optim_overlap=False, cpu_optim_speculative=True)
    times = [evaluate(prof, HW, spec.knobs, replace(cfg, speculate_chunks=n)).prediction.iter_time
             for n in range(n_off + 1)]
    assert spec.prediction.iter_time == pytest.approx(min(times), rel=1e-12)
    assert times[spec.n_speculate] == pytest.approx(min(times), rel=1e-12)
    assert min(times) < times[0]


def test_backups_that_do_not_fit_the_host_memory_left_are_not_planned():
    prof, _, spec = plans()
    layout = build_layout(prof, spec.knobs.chunk_size // prof.param_bytes)
    one = 12 * int(layout.used[-1])
    base_host = spec.prediction.host_bytes - 12 * int(np.sum(layout.used[layout.n_chunks - spec.n_speculate:]))
    tight = replace(HW, host_memory=base_host + one)          # room for the last chunk's backup only
    cfg = PlannerConfig(pins=PINS, cpu_optim_overlap=False, cpu_optim_speculative=True)
    p = evaluate(prof, tight, spec.knobs, cfg)
    assert p.n_speculate == 1 and p.prediction.host_bytes <= tight.host_memory


def test_on_a_cpu_device_nothing_speculates():
    """No copy engine: CPU Adam runs on the compute timeline, so a speculative update is pure
    extra work (its backup) and the planner picks none; a pin still wins."""
    serial = replace(HW, copy_engines=0)
    prof = analytic_profile(SHAPE, serial)
    cfg = PlannerConfig(pins=PINS, cpu_optim_overlap=False, cpu_optim_speculative=True)
    assert search(prof, serial, cfg).n_speculate == 0
    assert search(prof, serial, replace(cfg, speculate_chunks=2)).n_speculate == 2


def test_updates_left_by_step_are_predicted_to_run_into_the_next_forward():
    """Clipping, nothing speculating: every offloaded update is left for after backward. The
    runtime lets them run on into the next forward, which waits only where a chunk's upload
    needs its update; the prediction counts that wait, not the whole tail."""
    from protrain.cost.time_model import simulate
    from protrain.block_mode import layout_block_modes
    prof = analytic_profile(SHAPE, HW)
    cfg = PlannerConfig(pins=PINS, cpu_optim_overlap=False)
    plan = search(prof, HW, cfg)
    k = plan.knobs
    layout = build_layout(prof, k.chunk_size // prof.param_bytes)
    codes = np.array([[m.code for m in layout_block_modes(prof.n_blocks, k.n_swap, k.n_checkpoint,
                                                           k.n_ssd, k.n_selective)]])
    args = (prof, layout, HW, k.n_persist, k.n_buffer, codes)
    whole = simulate(*args, cpu_overlap=False)
    carried = simulate(*args, cpu_overlap=False, carry_over=True)
    device_end = float(whole.fwd_time[0] + whole.bwd_time[0] + whole.gpu_optim_time[0])
    assert plan.prediction.iter_time == pytest.approx(float(carried.iter_time[0]), rel=1e-12)
    assert float(whole.iter_time[0]) > float(carried.iter_time[0]) >= max(device_end,
                                                                          float(carried.cpu_optim_time[0]))
    assert plan.prediction.cpu_optim_exposed == pytest.approx(plan.prediction.iter_time - device_end)
    # The forward's slack before the first offloaded upload is what the tail hides behind:
    # with more chunks persistent (computed first) the wait shrinks.
    more = replace(PINS, n_persist=PINS.n_persist + 4)
    p2 = search(prof, HW, PlannerConfig(pins=more, cpu_optim_overlap=False))
    assert p2.prediction.cpu_optim_exposed < plan.prediction.cpu_optim_exposed


def test_the_runtime_rule_after_a_clipped_step_is_priced():
    """A step after one that clipped does not speculate (the unspeculated plan's iteration); a
    speculated step that clips restores and redoes its chunks (slower than not speculating);
    the mean over a clipping fraction follows the rule, and a plan that never speculates is
    indifferent to clipping."""
    from protrain.cost.time_model import simulate
    from protrain.block_mode import layout_block_modes
    prof, after, spec = plans()
    p = spec.prediction
    assert p.iter_time < p.iter_time_unspeculated < p.iter_time_rolled_back
    assert p.iter_time_unspeculated == pytest.approx(after.prediction.iter_time, rel=1e-12)
    # the exposed CPU Adam of a step that does not speculate, as the plan without speculation
    # (what bench/cpu_adam_exposed.py compares a round of clipped steps with)
    assert p.cpu_optim_exposed_unspeculated == pytest.approx(after.prediction.cpu_optim_exposed, rel=1e-12)
    assert p.cpu_optim_exposed < p.cpu_optim_exposed_unspeculated
    k = spec.knobs
    layout = build_layout(prof, k.chunk_size // prof.param_bytes)
    codes = np.array([[m.code for m in layout_block_modes(prof.n_blocks, k.n_swap, k.n_checkpoint,
                                                           k.n_ssd, k.n_selective)]])
    trace = []
    wrong = simulate(prof, layout, HW, k.n_persist, k.n_buffer, codes, cpu_overlap=False,
                     speculate_from=layout.n_chunks - spec.n_speculate, speculation_wrong=True,
                     carry_over=True, trace=trace)
    assert float(wrong.iter_time[0]) == pytest.approx(p.iter_time_rolled_back, rel=1e-12)
    restored = {e[2] for e in trace if e[1] == "rollback"}
    assert restored == {f"chunk {c}" for c in range(layout.n_chunks - spec.n_speculate, layout.n_chunks)}
    means = [p.expected_iter_time(f) for f in np.linspace(0, 1, 11)]
    assert means[0] == p.iter_time and means[-1] == pytest.approx(p.iter_time_unspeculated, rel=1e-12)
    assert all(p.iter_time <= m <= p.iter_time_rolled_back for m in means)
    assert p.expected_iter_time(0.25) == pytest.approx(
        0.75 * (0.75 * p.iter_time + 0.25 * p.iter_time_rolled_back) + 0.25 * p.iter_time_unspeculated)
    assert after.prediction.expected_iter_time(0.5) == after.prediction.iter_time
    with pytest.raises(ValueError, match="clip_fraction"):
        p.expected_iter_time(1.5)
