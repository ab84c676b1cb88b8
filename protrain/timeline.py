"""One iteration as a timeline: what ran when, on which queue, and the device memory under it.

One event format for predicted and measured time: the cost model's simulation emits a
Timeline for a plan (``cost.predicted_timeline``), the runtime records one per
iteration (``runtime.timeline_recorder.TimelineRecorder``); both are drawn the same way, side
by side, so the prediction is compared with the measurement like for like.

Lanes (top to bottom): compute (device kernels: forward, recompute, backward, device Adam),
H2D and D2H (the copy queues: chunk uploads, gradient offloads, swapped activations), CPU Adam
(one bar per offloaded chunk's update; backups, rollbacks and redone updates marked), NVMe
(activation writes and reads). Under them, the device memory curve.

matplotlib is an optional extra (``pip install protrain[plot]``); everything but ``draw`` works
without it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .serde import JsonValue

LANES = ("compute", "h2d", "d2h", "cpu_adam", "nvme", "collective")
LANE_TITLES = {"compute": "compute", "h2d": "H2D", "d2h": "D2H", "cpu_adam": "CPU Adam",
               "nvme": "NVMe", "collective": "all-reduce"}


@dataclass(frozen=True, slots=True)
class Event:
    """Something that occupied a queue from ``start`` to ``end`` (seconds from the start of the
    iteration)."""

    lane: str
    """One of LANES."""
    what: str
    """Kind of work: fwd, bwd, recompute, device_adam, upload, offload, swap_out, swap_in,
    adam, backup_adam (a speculative update), rollback, redo, check (a chunk's clipping norms /
    overflow test), nvme_write, nvme_read, wait."""
    label: str
    """Which instance: "block 3", "chunk 12", ..."""
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Timeline(JsonValue):
    """An iteration's events and its device-memory curve."""

    source: str
    """"predicted" (the cost model) or "measured" (the runtime's recorder)."""
    title: str
    """What it is of: the model and plan."""
    events: tuple[Event, ...]
    memory: tuple[tuple[float, int], ...] = ()
    """(seconds, device bytes) points of the memory curve, in time order."""
    memory_limit: int = 0
    """The device budget the plan was made for (drawn as a line; 0: none)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Totals worth printing beside the plot (iteration time, exposed CPU Adam ...)."""

    @property
    def duration(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    def lane_busy(self, lane: str) -> float:
        """Seconds the lane was busy (overlapping events counted once)."""
        spans = sorted((e.start, e.end) for e in self.events if e.lane == lane)
        busy, until = 0.0, float("-inf")
        for a, b in spans:
            if b > until:
                busy += b - max(a, until)
                until = b
        return busy


_COLORS = {"fwd": "#4878d0", "bwd": "#ee854a", "recompute": "#d65f5f", "device_adam": "#956cb4",
           "upload": "#6acc64", "offload": "#8c613c", "swap_out": "#dc7ec0", "swap_in": "#797979",
           "adam": "#82c6e2", "backup_adam": "#d5bb67", "rollback": "#000000", "redo": "#b33",
           "nvme_write": "#8172b3", "nvme_read": "#64b5cd", "wait": "#cccccc", "check": "#2ca02c",
           "step": "#17becf"}


def draw(timelines: list[Timeline] | Timeline, out: str | Path) -> Path:
    """Draw one timeline, or several side by side on a common time axis (predicted beside
    measured), to an image file (PNG, SVG, PDF: by extension)."""
    fig = figure(timelines)
    import matplotlib.pyplot as plt
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def figure(timelines: list[Timeline] | Timeline):
    """The matplotlib figure ``draw`` saves: a column per timeline, the lanes above (one bar
    per event, y = the lane's row), the device memory curve below."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise SystemExit("drawing a timeline needs matplotlib: pip install 'protrain[plot]' "
                         "(or pip install matplotlib)") from None
    tls = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    if not tls:
        raise ValueError("nothing to draw: no timeline given")
    lanes = [ln for ln in LANES if any(e.lane == ln for t in tls for e in t.events)] or ["compute"]
    horizon = max(t.duration for t in tls) or 1.0
    fig, axes = plt.subplots(2, len(tls), figsize=(7 * len(tls), 4.2), squeeze=False,
                             gridspec_kw={"height_ratios": [max(len(lanes), 2), 2]}, sharex=True)
    used = set()
    for col, t in enumerate(tls):
        ax, mem = axes[0][col], axes[1][col]
        for row, lane in enumerate(lanes):
            y = len(lanes) - 1 - row
            for e in t.events:
                if e.lane != lane or e.end <= e.start:
                    continue
                ax.broken_barh([(e.start * 1e3, (e.end - e.start) * 1e3)], (y + 0.1, 0.8),
                               facecolors=_COLORS.get(e.what, "#999999"), edgecolor="white",
                               linewidth=0.3)
                used.add(e.what)
        ax.set_yticks([len(lanes) - 1 - i + 0.5 for i in range(len(lanes))],
                      [LANE_TITLES[ln] for ln in lanes])
        ax.set_ylim(0, len(lanes))
        ax.set_xlim(0, horizon * 1e3)
        extra = ", ".join(f"{k} {v * 1e3:.1f} ms" if k.endswith("_s") else f"{k} {v:g}"
                          for k, v in t.stats.items())
        ax.set_title(f"{t.source}: {t.title}" + (f"\n{extra}" if extra else ""), fontsize=8)
        if t.memory:
            xs = [p[0] * 1e3 for p in t.memory]
            ys = [p[1] / 2**20 for p in t.memory]
            mem.step(xs, ys, where="post", color="#333333", linewidth=1)
            mem.fill_between(xs, ys, step="post", alpha=0.2, color="#4878d0")
            if t.memory_limit:
                mem.axhline(t.memory_limit / 2**20, color="#d65f5f", linestyle="--", linewidth=0.8)
        mem.set_ylabel("device MiB", fontsize=8)
        mem.set_xlabel("ms from the start of the iteration", fontsize=8)
    handles = [Patch(color=_COLORS[w], label=w) for w in _COLORS if w in used]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=7,
               frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig
