"""The runtime's recorder of measured iterations (protrain/timeline.py's format), so a
measured iteration is drawn like the predicted one: ``"trace_file"`` in the protrain section,
then ``protrain explain PLAN.json --plot out.png --trace TRACE.json``.

What it records, in wall-clock seconds from the iteration's first forward part:
- compute: each part's forward and backward (between the runtime's part-boundary hooks: a
  span includes what the main thread waited for there), and the device Adam in ``step``;
- h2d / d2h: chunk uploads and gradient offloads as the runtime issues them. On CPU copies are
  synchronous, so a span is the copy; on a GPU it is the issuing call only (the copy itself
  runs on its stream: CUDA events would be needed, not recorded yet);
- cpu_adam: each offloaded chunk's update (adam; backup_adam when speculative; rollback and
  redo), on whichever thread ran it;
- memory: device bytes at each part boundary (torch.cuda.memory_allocated on a GPU; the
  runtime's own count with ``"accounting": true`` on CPU; none otherwise).

An iteration (a micro-step: forward, backward and, at a boundary, the step) is written when
the next one starts (and at close): CPU Adam that runs on into
the next forward then shows at the start of the next iteration, where it ran. Recording costs
a clock read and a list append per event; nothing when the trace is off (no TimelineRecorder).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from ..timeline import Event, Timeline


class TimelineRecorder:
    def __init__(self, path: str | Path, title: str = "", memory=None):
        self.path = Path(path)
        self.title = title
        self.memory = memory            # () -> device bytes, or None
        self._lock = threading.Lock()
        self._events: list[tuple[str, str, str, float, float]] = []
        self._mem: list[tuple[float, int]] = []
        self._t0: float | None = None
        self._open: tuple[str, str, float] | None = None      # the compute span running
        self._seen_bwd = False
        self.iterations_written = 0

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def add(self, lane: str, what: str, label: str, start: float, end: float) -> None:
        with self._lock:
            self._events.append((lane, what, label, start, end))

    def part(self, what: str, label: str) -> None:
        """A part boundary on the main thread: close the running compute span, open this one."""
        t = self.now()
        if what == "fwd" and self._seen_bwd:
            self._close(t)
            self._flush(t)                # a new iteration starts
            self._seen_bwd = False
        self._seen_bwd |= what == "bwd"
        if self._t0 is None:
            self._t0 = t
        self._close(t)
        self._open = (what, label, t)
        if self.memory is not None:
            with self._lock:
                self._mem.append((t, int(self.memory())))

    def end_backward(self) -> None:
        self._close(self.now())

    def _close(self, t: float) -> None:
        if self._open is not None:
            what, label, start = self._open
            self.add("compute", what, label, start, t)
            self._open = None

    def _flush(self, until: float) -> None:
        """Write the iteration that started at t0 (events that started before ``until``)."""
        if self._t0 is None:
            return
        t0 = self._t0
        with self._lock:
            mine = [e for e in self._events if e[3] < until]
            self._events = [e for e in self._events if e[3] >= until]
            mem, self._mem = [m for m in self._mem if m[0] < until], [m for m in self._mem if m[0] >= until]
        tl = Timeline(source="measured", title=self.title,
                      events=tuple(Event(ln, w, lb, a - t0, b - t0) for ln, w, lb, a, b in mine),
                      memory=tuple((a - t0, b) for a, b in mem),
                      stats={"iteration_s": until - t0})
        tl.save(self.path)                # atomic (serde.dump_json): a reader never sees half a file
        self.iterations_written += 1
        self._t0 = until

    def close(self) -> None:
        t = self.now()
        self._close(t)
        self._flush(t)
