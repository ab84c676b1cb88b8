"""The cost model's iteration as a Timeline (protrain/timeline.py): the runtime model's
simulation of one plan, event by event, with the memory model's live bytes under it."""
from __future__ import annotations

import numpy as np

from ..profile.model_profile import ModelProfile
from ..timeline import Event, Timeline
from .memory import activation_walk_points
from .time_model import TimePrediction


def predicted_timeline(profile: ModelProfile, codes: np.ndarray, t: TimePrediction, trace: list, *,
                       model_state_bytes: int, title: str, memory_limit: int = 0) -> Timeline:
    """One plan's predicted iteration: ``t`` and ``trace`` from one ``simulate`` of it (called
    with ``trace=``; the plan's own prediction, simulated once). The memory curve steps at the
    end of each part's forward and backward to the model states plus the activations live
    there (the memory model's walk; between those points it is drawn flat)."""
    events = tuple(Event(lane, what, label, start, end) for lane, what, label, start, end in trace)
    walk = activation_walk_points(profile, codes)[0]
    ends: dict[tuple[str, str], float] = {}
    for e in events:
        if e.what in ("fwd", "bwd"):
            key = (e.what, e.label)
            ends[key] = max(ends.get(key, 0.0), e.end)
    points = [(0.0, model_state_bytes)]
    for p, part in enumerate(profile.parts):
        for i, what in enumerate(("fwd", "bwd")):
            if (what, part.name) in ends:
                points.append((ends[(what, part.name)], model_state_bytes + max(int(walk[2 * p + i]), 0)))
    points.sort()
    stats = {"iteration_s": float(t.iter_time[0]), "cpu_adam_s": float(t.cpu_optim_time[0]),
             "cpu_adam_exposed_s": float(t.cpu_optim_exposed[0])}
    return Timeline(source="predicted", title=title, events=events, memory=tuple(points),
                    memory_limit=memory_limit, stats=stats)
