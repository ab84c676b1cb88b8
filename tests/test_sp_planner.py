"""The sequence-parallel degree as a planner knob: constraints, the per-rank profile (checked
against measured ones), the outer loop's choice and its reasons, and `protrain plan --world`."""
import re
from dataclasses import replace

import pytest
import torch

from protrain.cli import main as cli
from protrain.config import ConfigError, KnobPins, PlannerConfig
from protrain.models import GPT, GPTConfig, synthetic_batch
from protrain.profile.hardware import HardwareProfile
from protrain.measure.profiler import profile_model
from protrain.search import InfeasibleError
from protrain.sp import SPShape, broken_constraints, check_degree, scale_profile, valid_degrees
from protrain.sp.planner import choose_degree, search_sequence_parallel

CFG = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=512)


def _profile(seq):
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = synthetic_batch(CFG, 2, seq)
    return profile_model(model, lambda m: m(x, y), progress=False, micro_batch=2, seq_len=seq)


@pytest.fixture(scope="module")
def profiles():
    """The same model profiled at three lengths."""
    return {s: _profile(s) for s in (128, 256, 512)}


def test_degree_constraints_name_what_breaks_them():
    shape = SPShape(world=8, heads=12, kv_heads=4, seq_len=1000)
    assert valid_degrees(shape) == (1, 2, 4)          # 8: heads; also 1000 % 8 == 0 but 12 % 8
    assert any("head count (12 heads)" in b for b in broken_constraints(8, shape))
    assert broken_constraints(3, shape) == [
        "P must divide the world size (8 ranks)",
        "the KV-head rule: kv_heads % P == 0 or P % kv_heads == 0 (4 KV heads)",
        "P must divide the sequence length (1000 tokens)"]
    gqa = SPShape(world=4, heads=6, kv_heads=3, seq_len=64)
    assert any("KV-head rule" in b for b in broken_constraints(2, gqa))
    assert valid_degrees(SPShape(world=8, heads=32, kv_heads=2, seq_len=4096)) == (1, 2, 4, 8)  # replicated KV
    with pytest.raises(ConfigError, match=r"protrain.sequence_parallel = 2: the KV-head rule.*Valid "
                                          r"values here: 1"):
        check_degree(2, gqa)


def test_scaled_profile_matches_profiles_measured_at_that_length(profiles):
    """Activation bytes grow with the tokens a rank holds, backward's parameter gradients do
    not: fitted through two profiles, the bytes at 512 tokens, or at 512 split over 2 or 4
    ranks, are those measured at 512, 256 and 128 tokens. (A peak is the largest of several
    such lines: the fit holds where one operator keeps the peak, here from 128 tokens on.)"""
    p128, p256, p512 = profiles[128], profiles[256], profiles[512]
    fields = ("in_bytes", "saved_bytes", "fwd_start", "fwd_peak", "bwd_start", "bwd_peak",
              "sel_saved_bytes", "attn_io_bytes")
    cases = ((p512, scale_profile(p128, seq_len=512, second=p256)),
             (p256, scale_profile(p512, seq_len=512, degree=2, alltoall_bandwidth=1e9, second=p128)),
             (p128, scale_profile(p512, seq_len=512, degree=4, alltoall_bandwidth=1e9, second=p256)))
    for target, scaled in cases:
        assert scaled.seq_len == 512 and scaled.n_blocks == target.n_blocks
        held = 0
        for got, want in zip(scaled.parts, target.parts):
            # With P > 1 each block also saves its attention output as it comes back from the
            # all-to-all (a copy; measured on 2 ranks in test_sequence_parallel), and the
            # selective mode keeps the all-to-alls' outputs.
            h, kv = scaled.heads, scaled.kv_heads                 # output: h of 2 h + 2 kv heads
            extra = got.attn_io_bytes * h // (2 * h + 2 * kv) \
                if scaled.sequence_parallel > 1 and got.kind == "block" else 0
            shift = {"saved_bytes": extra, "fwd_start": held, "fwd_peak": held + extra,
                     "bwd_start": held + extra, "bwd_peak": held + extra,
                     "sel_saved_bytes": got.attn_io_bytes if scaled.sequence_parallel > 1 else 0}
            for f in fields:
                assert getattr(got, f) - shift.get(f, 0) == pytest.approx(getattr(want, f), rel=0.002, abs=64), \
                    (got.name, f, scaled.sequence_parallel)
            held += extra
    # From one profile the figures are taken as linear: high when scaling up (backward's
    # parameter gradients scaled too), forward exact.
    linear = scale_profile(p128, seq_len=512)
    assert all(g.bwd_peak >= w.bwd_peak and g.fwd_peak == pytest.approx(w.fwd_peak, rel=0.002)
               for g, w in zip(linear.blocks, p512.blocks))
    short = p128
    # Time: the attention share grows with s (s^2 against s); with P the all-to-alls are added
    # and are what the selective mode does not re-run.
    s4 = scale_profile(short, seq_len=512)
    b0, b4 = short.blocks[0], s4.blocks[0]
    assert b4.attn_fwd_time == pytest.approx(16 * b0.attn_fwd_time)
    assert b4.fwd_time - b4.attn_fwd_time == pytest.approx(4 * (b0.fwd_time - b0.attn_fwd_time))
    p2 = scale_profile(short, seq_len=512, degree=2, alltoall_bandwidth=1e9)
    c = p2.blocks[0]
    assert c.comm_fwd_time > 0 and c.attn_fwd_time == pytest.approx(8 * b0.attn_fwd_time)
    assert c.sel_recompute_time == pytest.approx(c.fwd_time - c.attn_fwd_time - c.comm_fwd_time)
    assert c.sel_saved_bytes == pytest.approx(2 * b0.sel_saved_bytes + c.attn_io_bytes, abs=2)


def test_a_longer_and_wider_batch_is_planned_from_the_first_profile_with_an_upper_bound():
    """A batch longer (and with more samples) than the profiled one: time scales with the
    tokens (attention with the sequence squared), and the byte figures scaled linearly bound
    the ones measured at that shape, tightly where activations dominate. A fit through two
    short profiles is not a bound: a steeper line can overtake further on (the head's backward
    peak here), which is why the planner fits only below the measured length."""
    short, half = _profile(16), _profile(8)
    torch.manual_seed(0)
    x, y = synthetic_batch(CFG, 4, 64)
    wide = profile_model(GPT(CFG), lambda m: m(x, y), progress=False, micro_batch=4, seq_len=64)
    scaled = scale_profile(short, seq_len=64, micro_batch=4)
    assert (scaled.micro_batch, scaled.seq_len) == (4, 64)
    fields = ("in_bytes", "saved_bytes", "fwd_start", "fwd_peak", "bwd_start", "bwd_peak")
    for got, want in zip(scaled.parts, wide.parts):
        for f in fields:
            assert getattr(got, f) >= getattr(want, f) * (1 - 0.002), (got.name, f)
    blocks = [(g, w) for g, w in zip(scaled.blocks, wide.blocks)]
    assert all(g.fwd_peak == pytest.approx(w.fwd_peak, rel=0.01) for g, w in blocks)
    b0, b = short.blocks[0], scaled.blocks[0]
    assert b.attn_fwd_time == pytest.approx(2 * 16 * b0.attn_fwd_time)          # (b / b0) (s / s0)^2
    assert b.fwd_time - b.attn_fwd_time == pytest.approx(2 * 4 * (b0.fwd_time - b0.attn_fwd_time))
    fitted = scale_profile(short, seq_len=64, second=half)
    measured = _profile(64)
    assert fitted.parts[-1].bwd_peak < measured.parts[-1].bwd_peak <= \
        scale_profile(short, seq_len=64).parts[-1].bwd_peak
    with pytest.raises(ValueError, match="same model and micro-batch"):
        scale_profile(short, seq_len=64, second=scaled)


def _machine(**over) -> HardwareProfile:
    kw = dict(name="hand", source="measured", device_type="cpu", device_memory=2**40,
              host_memory=2**40, h2d_bandwidth=1e10, d2h_bandwidth=1e10, gpu_adam_rate=1e9,
              cpu_adam_rate=1e9, collective_bandwidth=1e10, alltoall_bandwidth=1e10)
    kw.update(over)
    return HardwareProfile(**kw)


def _need(profile, degree, seq_len):
    """Device memory (with margin) the leanest plan at ``degree`` needs."""
    cfg = PlannerConfig(device_memory=1, data_parallel_size=2, pins=KnobPins(sequence_parallel=degree))
    with pytest.raises(InfeasibleError) as e:
        search_sequence_parallel(profile, _machine(), cfg, seq_len=seq_len)
    return e.value.device_needed


def test_auto_picks_a_degree_that_fits_and_says_why(profiles):
    prof = profiles[128]
    one, two = _need(prof, 1, 1024), _need(prof, 2, 1024)
    assert two < one
    budget = (one + two) // 2
    cfg = PlannerConfig(device_memory=budget, data_parallel_size=2)
    plan = search_sequence_parallel(prof, _machine(), cfg, seq_len=1024)
    assert plan.knobs.sequence_parallel == 2
    assert plan.prediction.peak_device_bytes * 1.1 <= budget
    assert any(n.startswith("P=1 does not fit: needs") for n in plan.notes), plan.notes
    assert any(n.startswith("P=2: step") and n.endswith("chosen") for n in plan.notes), plan.notes
    text = plan.explain()
    assert "sequence_parallel  2" in text and "P=1 does not fit" in text
    # Room for P=1: it needs no all-to-all, so it is at least as fast and chosen.
    roomy = search_sequence_parallel(prof, _machine(), replace(cfg, device_memory=4 * one), seq_len=1024)
    assert roomy.knobs.sequence_parallel == 1
    # A model the runtime cannot split stays at P=1 and says why; a pin above 1 is refused.
    with pytest.raises(InfeasibleError, match="P=1 does not fit"):
        search_sequence_parallel(prof, _machine(), cfg, seq_len=1024, unsupported="no position_ids")
    with pytest.raises(ConfigError, match="no position_ids"):
        search_sequence_parallel(prof, _machine(), replace(cfg, pins=KnobPins(sequence_parallel=2)),
                                 seq_len=1024, unsupported="no position_ids")


def _seconds(text: str) -> float:
    """A time as fmt_seconds prints it ("812.4 ms", "1.23 s", "950 us"): the measured profile's
    times, and so the unit, depend on the machine's speed."""
    value, unit = text.split()
    return float(value) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]


def test_degrees_predicted_within_the_error_band_hedge_to_the_smaller(profiles):
    prof = profiles[128]
    # Room for P=1 only with recompute; P=2 keeps everything: it is predicted faster.
    cfg = PlannerConfig(device_memory=int(_need(prof, 1, 1024) * 1.3), data_parallel_size=2)
    fast_links = _machine(alltoall_bandwidth=1e15)
    sure = search_sequence_parallel(prof, fast_links, replace(cfg, time_tolerance=0.0), seq_len=1024)
    assert sure.knobs.sequence_parallel == 2
    assert not any("chosen over" in n for n in sure.notes)
    # A difference inside the model's error band: the smaller degree, and the plan says so.
    hedged = search_sequence_parallel(prof, fast_links, replace(cfg, time_tolerance=0.5), seq_len=1024)
    assert hedged.knobs.sequence_parallel == 1
    step = {int(n[2]): _seconds(n.split("step ")[1].split(",")[0]) for n in hedged.notes
            if n.startswith("P=") and ": step " in n}
    assert step[2] < step[1] <= 1.5 * step[2]
    assert any(n.startswith("P=1: step") and n.endswith("- chosen") for n in hedged.notes), hedged.notes
    said = re.search(r"P=1 chosen over P=2: P=2 is predicted (\d+\.\d)% faster", " ".join(hedged.notes))
    # the steps are printed rounded (to 0.1 ms, or 0.01 s on a slow machine): allow for it
    slack = sum(0.05e-3 if step[p] < 1.0 else 0.005 for p in (1, 2)) / step[1]
    assert said and float(said.group(1)) == pytest.approx(100 * (1 - step[2] / step[1]),
                                                          abs=0.1 + 100 * slack)
    assert "within the model's 50% error band" in " ".join(hedged.notes)
    assert choose_degree({}, 0.05) is None


@pytest.mark.parametrize("clip", [False, True])
def test_a_degree_whose_floor_lies_above_the_fastest_is_skipped_and_changes_nothing(monkeypatch, clip):
    """A degree whose floor (compute, uploads and CPU Adam alone) lies above the fastest step
    found and its error band is not searched: the plan equals the one from searching every
    degree, and the note gives the floor, which lies below that degree's own best step."""
    import protrain.sp.planner as sp_planner
    from protrain.profile.analytic import ModelShape, analytic_profile
    from protrain.profile.machines import machine
    shape = ModelShape("small", "gpt2", n_layers=4, hidden=256, heads=4, vocab=2048, seq_len=256,
                       micro_batch=4, max_positions=256)
    hw = machine("rtx3090").profile(host_memory=4 * 2**30)
    prof = analytic_profile(shape, hw)
    # (whole persistent chunks: sharded ones lower the floor of device Adam by 4x here, and
    # P=2 is then searched)
    cfg = PlannerConfig(data_parallel_size=4, cpu_optim_overlap=not clip, cpu_optim_speculative=clip,
                        pins=KnobPins(n_shard=0))
    plan = search_sequence_parallel(prof, hw, cfg)
    floor = {int(n[2]): _seconds(n.split("at least ")[1].split(" per step")[0]) for n in plan.notes
             if re.match(r"P=\d not searched: every plan takes at least .* slower than P=1's", n)}
    assert sorted(floor) == [2, 4], plan.notes
    monkeypatch.setattr(sp_planner, "search_floor", lambda *a: 0.0)      # every degree searched
    every = search_sequence_parallel(prof, hw, cfg)
    assert (plan.knobs, plan.prediction) == (every.knobs, every.prediction)
    step = {int(n[2]): _seconds(n.split("step ")[1].split(",")[0]) for n in every.notes
            if re.match(r"P=\d: step", n)}
    for p, f in floor.items():
        assert f <= step[p] + 0.05e-3 and f > step[1] * (1 + cfg.time_tolerance) - 0.05e-3, (p, f, step)


def test_a_pinned_degree_that_breaks_a_constraint_is_refused(profiles):
    prof = profiles[128]
    cfg = PlannerConfig(data_parallel_size=4, pins=KnobPins(sequence_parallel=3))
    with pytest.raises(ConfigError, match=r"sequence_parallel = 3: P must divide the world size \(4 "
                                          r"ranks\); P must divide the attention head count \(4 heads\).*"
                                          r"Valid values here: 1, 2, 4"):
        search_sequence_parallel(prof, _machine(), cfg, seq_len=1024)
    gqa = replace(prof, heads=6, kv_heads=3)
    with pytest.raises(ConfigError, match="KV-head rule"):
        search_sequence_parallel(gqa, _machine(), replace(cfg, pins=KnobPins(sequence_parallel=2)),
                                 seq_len=1024)


def test_plan_command_plans_long_sequences_over_ranks(capsys):
    # (the MLPs untiled: tiled, one rank fits 128K tokens - tests/test_tiled_mlp_plans.py)
    assert cli(["plan", "--model", "llama3-8b", "--world", "8", "--seq", "131072", "--pin", "mlp_tile=0"]) == 0
    out = capsys.readouterr().out
    assert "sequence_parallel" in out and "P=1 does not fit" in out
    modes = next(line for line in out.splitlines() if "block modes" in line).split()[-1]
    assert "A" in modes                                   # selective blocks at 128k tokens
    p = int(next(line for line in out.splitlines() if line.strip().startswith("sequence_parallel")).split()[1])
    assert p > 1 and 8 % p == 0
    assert cli(["plan", "--model", "llama3-8b", "--world", "8", "--seq", "131072",
                "--pin", "sequence_parallel=3"]) == 2
    assert "P must divide the world size (8 ranks)" in capsys.readouterr().err


def test_deepspeed_sequence_parallel_size_is_taken_as_the_pin():
    from protrain_ds.config import ProTrainDSConfig, strip_replaced_knobs
    on = {"protrain": {"enabled": True}}
    assert ProTrainDSConfig.from_ds_config(on).planner.pins.sequence_parallel is None       # auto
    cfg = ProTrainDSConfig.from_ds_config(dict(on, sequence_parallel_size=4))
    assert cfg.planner.pins.sequence_parallel == 4
    assert ProTrainDSConfig.from_ds_config(
        {"protrain": {"enabled": True, "sequence_parallel": 2}}).planner.pins.sequence_parallel == 2
    with pytest.raises(ConfigError, match="sequence_parallel_size = 4 and protrain.sequence_parallel = 2 "
                                          "disagree"):
        ProTrainDSConfig.from_ds_config({"sequence_parallel_size": 4,
                                         "protrain": {"enabled": True, "sequence_parallel": 2}})
    with pytest.raises(ConfigError, match=r"protrain.sequence_parallel = 0: must be a whole number >= 1"):
        ProTrainDSConfig.from_ds_config({"protrain": {"enabled": True, "sequence_parallel": 0}})
    with pytest.raises(ConfigError, match="profile_seq_len"):
        ProTrainDSConfig.from_ds_config({"protrain": {"enabled": True, "profile_seq_len": "long"}})
    # DeepSpeed itself does not see it (it would build its own sequence-parallel groups).
    clean, overridden = strip_replaced_knobs(dict(on, sequence_parallel_size=4))
    assert "sequence_parallel_size" not in clean
    assert any("sequence_parallel_size=4 (taken as protrain.sequence_parallel)" in o for o in overridden)
