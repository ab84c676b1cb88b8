"""The iteration drawn: the plan's predicted timeline (the runtime model's own events) and a
measured one recorded by the runtime (``"trace_file"``), side by side by ``protrain explain``."""
import numpy as np
import pytest

from dstrain import base_config, train, with_protrain
from test_ds_engine import SHAPES

from protrain.cli import main
from protrain.config import PlannerConfig
from protrain.plan import Plan
from protrain.profile.analytic import analytic_profile
from protrain.search import search
from protrain.timeline import LANE_TITLES, Timeline, figure
from test_speculation_plan import HW, PINS, SHAPE

PNG = b"\x89PNG\r\n\x1a\n"


def drawn(fig, col: int) -> tuple[dict[str, list], list]:
    """What column ``col`` of a drawn figure shows: {lane title: sorted (start, end) bars in
    seconds}, and the memory curve's (seconds, bytes) points."""
    axes = fig.get_axes()
    n_cols = len(axes) // 2
    top, mem = axes[col], axes[n_cols + col]
    rows = {round(t - 0.5): lab.get_text() for t, lab in zip(top.get_yticks(), top.get_yticklabels())}
    bars: dict[str, list] = {}
    for coll in top.collections:
        for path in coll.get_paths():
            (x0, y0), (x1, _) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            bars.setdefault(rows[int(y0)], []).append((x0 / 1e3, x1 / 1e3))
    curve = [(x / 1e3, y * 2**20) for x, y in mem.lines[0].get_xydata()] if mem.lines else []
    return {k: sorted(v) for k, v in bars.items()}, curve


def assert_drawn_as(fig, col: int, t: Timeline) -> None:
    """Every event of ``t`` is a bar in its lane's row at its times; the memory curve is t's."""
    bars, curve = drawn(fig, col)
    want: dict[str, list] = {}
    for e in t.events:
        if e.end > e.start:
            want.setdefault(LANE_TITLES[e.lane], []).append((e.start, e.end))
    assert set(bars) == set(want)
    for lane, spans in want.items():
        np.testing.assert_allclose(bars[lane], sorted(spans), rtol=1e-9, atol=1e-12, err_msg=lane)
    np.testing.assert_allclose(curve, [(s, float(b)) for s, b in t.memory], rtol=1e-9)


def test_the_predicted_timeline_is_the_runtime_models_iteration(tmp_path):
    prof = analytic_profile(SHAPE, HW)
    plan = search(prof, HW, PlannerConfig(pins=PINS, cpu_optim_overlap=False, cpu_optim_speculative=True))
    t, p = plan.timeline, plan.prediction
    assert t is not None and t.source == "predicted"
    assert t.stats["iteration_s"] == pytest.approx(p.iter_time, rel=1e-12)
    # one bar per offloaded chunk's update (the clipping norms are taken on the GPU); CPU Adam
    # runs one chunk at a time
    n_off = plan.chunks.n_chunks - plan.knobs.n_persist
    assert sum(e.lane == "cpu_adam" for e in t.events) == n_off
    assert t.lane_busy("cpu_adam") == pytest.approx(p.cpu_optim_time, rel=1e-9)
    assert any(e.what == "backup_adam" for e in t.events) == (plan.n_speculate > 0)
    fwd_end = max(e.end for e in t.events if e.what == "fwd")
    assert fwd_end == pytest.approx(p.fwd_time, rel=1e-9)
    assert max(m for _, m in t.memory) == pytest.approx(p.peak_device_bytes, rel=0.01)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path).timeline == t
    out = tmp_path / "plan.png"
    assert main(["explain", str(path), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000
    fig = figure(t)
    assert len(fig.get_axes()) == 2
    assert_drawn_as(fig, 0, t)
    assert {"compute", "H2D", "D2H", "CPU Adam"} <= set(drawn(fig, 0)[0])


def test_a_recorded_iteration_is_drawn_beside_the_prediction(tmp_path):
    model_cfg, pins = SHAPES["a mix"]
    trace, plan_file = tmp_path / "trace.json", tmp_path / "plan.json"
    _, _, engine = train(with_protrain(base_config(gradient_clipping=1.0), **pins, trace_file=str(trace),
                                       plan_file=str(plan_file), accounting=True), model_cfg, 3)
    n_off = len(engine.protrain_runtime.chunks.offloaded())
    engine.destroy()
    t = Timeline.load(trace)
    assert t.source == "measured"
    # a span per boundary the runtime hooks: the blocks and the part after them forward, the
    # blocks and the part before them backward
    fwd, bwd = ({e.label for e in t.events if e.what == w} for w in ("fwd", "bwd"))
    assert len(fwd) == len(bwd) == model_cfg.n_layer + 1
    assert sum(e.what == "adam" for e in t.events) == n_off      # each offloaded chunk, once
    assert sum(e.what == "upload" for e in t.events) >= n_off
    assert all(0 <= e.start <= e.end <= t.stats["iteration_s"] for e in t.events)
    assert t.memory and all(b > 0 for _, b in t.memory)
    out = tmp_path / "side.png"
    assert main(["explain", str(plan_file), "--plot", str(out), "--trace", str(trace)]) == 0
    assert out.read_bytes()[:8] == PNG
    predicted = Plan.load(plan_file).timeline
    fig = figure([predicted, t])                  # what --trace draws: side by side
    assert len(fig.get_axes()) == 4
    assert_drawn_as(fig, 0, predicted)
    assert_drawn_as(fig, 1, t)
    assert fig.get_axes()[0].get_xlim() == fig.get_axes()[1].get_xlim()     # one time axis
    assert main(["explain", str(plan_file), "--trace", str(trace)]) == 2      # --trace needs --plot
