"""The search: the fastest plan that fits the device and host budgets.

Exhaustive over chunk size, n_persist, n_checkpoint and n_swap; exact over n_buffer through a
property of the runtime model (more buffers never delay anything), so each point takes the
most buffers that still fit, and only ties are re-checked with fewer. n_nvme (optimizer states
on the drive) is the fewest that fit the host (``space._drive_states`` says why that is the
fastest), so it adds no points. Points are evaluated in
order of a lower bound on their iteration time (compute alone, each copy queue alone, the CPU
optimizer alone) and the search stops when no remaining bound can beat the best time found:
the answer equals a brute-force search over all five knobs (tests check it), in a fraction of
its time. The points themselves are worked out (fitted) only as the bounds reach them: the
space comes in pairs of a block of activation configurations and an n_persist, each with
bounds on its points' step and bytes (``search.pairs``), fitted in bound order for the
fastest time and in bytes order for the hedge. After ``EXACT_SIMULATIONS`` the search accepts
a plan within ``TIE_TOLERANCE`` of the best bound left (the notes say so).

The search hedges against the cost model's own error: every plan predicted within
``PlannerConfig.time_tolerance`` of the fastest counts as equally fast, and among those the one
that moves the fewest bytes per step (host <-> device, NVMe) wins - a difference the model
cannot resolve is no reason to take on transfers whose overlap it may have overrated. Then
the faster, then the lower peak. The plan's notes say when this changed the choice.

Four phases over one _SearchState: the fastest time (points in bound order), the hedge band
(points by bytes moved), the fewest buffers of the tied points (bisection), the winner with
its runner-ups and notes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace

import numpy as np

from ..config import PlannerConfig
from ..cost.memory import buffer_numel
from ..plan import Alternative, Knobs, Plan
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from ..units import fmt_bytes, fmt_seconds
from .bounds import refine_cpu_bound, refine_speculating_reads, speculating_reads
from .candidates import ActivationConfigs, CandidateGrid
from .diagnosis import diagnose_infeasible
from .evaluation import evaluate, simulate_points, simulate_points_speculating
from .policy import planned_state_bytes
from .pairs import PairSpace, activation_free_floor, fit_pairs, pair_space
from .space import (activation_configs, candidate_capacities, chunk_bytes_prefix, least_state_drive_time,
                    note_buffers, reupload_bytes, search_floor)

_BATCH = 2048
_FIRST_BATCH = 256
"""The first batch of the fastest-time phase and of the hedge; the next ones ``_BATCH``. A
simulation's cost is mostly per call (its loops over parts and chunks), yet where the bounds
are tight the first few hundred points hold the fastest and rule out the rest (a 206B model:
one simulation of 2048 points takes 0.9 s, of 256 0.4 s)."""
_FIT_POINTS = 16384
"""Points' worth of pairs fitted at a time, in bound order, while the fastest time is sought."""
_SWEEP = 128
"""Buffer counts per point tried in one round of the tie refinement (``_bisect_buffers``)."""
EXACT_SIMULATIONS = 2048
"""Simulations after which the search accepts a plan within ``TIE_TOLERANCE`` of the best
unsimulated bound instead of simulating every near-tie. Models whose step is bound by one
resource (CPU Adam on a 70B model) have tens of thousands of plans within a few milliseconds
of each other; below this count the answer is exactly the brute-force one."""
TIE_TOLERANCE = 5e-4
"""Relative time the unsimulated plans may still gain when the search stops early: a
hundredth of the hedge's band (``PlannerConfig.time_tolerance``), far below what the model can
resolve. Where CPU Adam overlapping backward binds, the bound lies a few milliseconds under
every plan (the next forward's wait for the chunk updated last depends on where its upload
starts); at 1e-4 the 70B with a drive, clipping off, simulated 84 k plans to confirm ties of
0.02%."""

# How far above the best time a lower bound may lie and still be simulated: a bound is summed
# in another order than the simulation, so a plan tied with the best can have a bound a
# rounding error above it.
BOUND_ROUNDING = 1e-9


_POINT_COLUMNS = tuple(f.name for f in fields(CandidateGrid) if f.name != "layout")

_COLUMNS = (("lower_bound", np.float64, 0.0), ("moved", np.float64, 0.0), ("owner", np.int64, 0),
            ("local", np.int64, 0), ("times", np.float64, np.inf), ("speculating", np.int64, 0),
            ("simulated", bool, False), ("considered", bool, False))
"""(name, dtype, initial value) of _SearchState's per-point columns."""


def plan_key(iter_time: float, peak: int, knobs: tuple) -> tuple:
    """Order between plans the model tells apart: faster, then smaller peak, then smaller knobs."""
    return (iter_time, peak, knobs)


def _tie_order(k: Knobs) -> tuple:
    """The knobs the inner search chooses in tie-break order: ``Knobs.as_tuple`` and n_shard
    (a point is simulated with two counts: ``search.sharding``)."""
    return k.as_tuple() + (k.n_shard,)


def hedged_key(moved: float, iter_time: float, peak: int, knobs: tuple) -> tuple:
    """Order between plans within the error band of the fastest: fewer bytes moved per step,
    then ``plan_key``."""
    return (moved,) + plan_key(iter_time, peak, knobs)


@dataclass
class _SearchState:
    """What the search knows of every candidate as it goes: the pairs of each chunk size
    (``pairs``: fitted once their bounds say they may be needed), and one row per point
    fitted so far (row ``local[i]`` of grid ``owner[i]``)."""

    profile: ModelProfile
    hw: HardwareProfile
    config: PlannerConfig
    acts: ActivationConfigs
    budget: float
    spaces: list[PairSpace]
    stats: dict
    """What the fitted points' nearest misses needed, for the diagnosis when nothing fits."""
    grids: list[CandidateGrid] = field(default_factory=list)
    grid_space: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """The chunk size (index into ``spaces``) of each grid."""
    rows: int = 0
    """Points fitted so far: the length of the per-point columns below."""
    _cols: dict = field(default_factory=lambda: {name: np.zeros(0, dtype=dtype) for name, dtype, _ in _COLUMNS})
    """Each per-point column with room to grow (its first ``rows`` entries are the points'):
    appended to as pairs are fitted, a few hundred times in a large search, so the room
    doubles rather than the arrays being copied at each fit."""
    refine_on_fit: bool = True
    """Whether fitted points get their refined bounds at once (``bounds.speculating_reads``):
    the fastest-time phase orders by them; the hedge refines only what it would simulate."""
    best: float = np.inf
    """The fastest step time simulated."""
    evaluated: int = 0
    """Simulations run (a point re-simulated with fewer buffers counts again)."""
    early: tuple[int, float] | None = None
    """(candidates left, the most they could be faster) when the search stopped early."""
    fewer_buffers: dict[int, tuple[int, int]] = field(default_factory=dict)
    """(n_buffer, peak) of the tied points whose fewest buffers keep their time and bytes."""

    lower_bound = property(lambda self: self._col("lower_bound"))
    """A lower bound on each point's step time, refined just before the point is simulated."""
    moved = property(lambda self: self._col("moved"))
    """Bytes each point moves per step (known without simulating)."""
    owner = property(lambda self: self._col("owner"))
    local = property(lambda self: self._col("local"))
    """Point i is row ``local[i]`` of grid ``owner[i]``."""
    times = property(lambda self: self._col("times"))
    """Each point's simulated step time; inf until simulated."""
    speculating = property(lambda self: self._col("speculating"))
    """Each simulated point's offloaded chunks speculating (``boundary_times``' pick)."""
    simulated = property(lambda self: self._col("simulated"))
    considered = property(lambda self: self._col("considered"))
    """Points the fastest-time phase has taken (simulated, or ruled out by their refined bound)."""

    def _col(self, name: str) -> np.ndarray:
        return self._cols[name][:self.rows]

    def _append(self, **values) -> None:
        """Append one grid's points: each column's values (the others their initial value)."""
        n = len(values["lower_bound"])
        if self.rows + n > len(self._cols["lower_bound"]):
            room = max(2 * (self.rows + n), 1024)
            for name, dtype, _ in _COLUMNS:
                grown = np.empty(room, dtype=dtype)
                grown[:self.rows] = self._cols[name][:self.rows]
                self._cols[name] = grown
        for name, _, initial in _COLUMNS:
            self._cols[name][self.rows:self.rows + n] = values.get(name, initial)
        self.rows += n

    def fit(self, pick) -> int:
        """Fit the unfitted pairs ``pick(space)`` selects (a mask over its pairs); their
        points join the rows. Returns how many pairs were fitted."""
        fitted = 0
        for ps in self.spaces:
            which = np.flatnonzero(~ps.fitted & pick(ps))
            if not len(which):
                continue
            fitted += len(which)
            g = fit_pairs(self.profile, self.hw, self.config, self.acts, ps, which, self.budget, self.stats)
            n = len(g.lower_bound)
            if not n:
                continue
            if self.refine_on_fit and speculating_reads(self.config, self.hw, g):
                # Cheap next to a simulation, and it orders the points far better where
                # speculating updates wait for their states' reads.
                g.lower_bound = np.concatenate([
                    refine_speculating_reads(self.profile, self.hw, self.config, g, np.arange(lo, min(lo + 4096, n)))
                    for lo in range(0, n, 4096)])
            self.grids.append(g)
            self.grid_space = np.append(self.grid_space, self.spaces.index(ps))
            self._append(lower_bound=g.lower_bound, moved=g.moved, owner=len(self.grids) - 1, local=np.arange(n))
        return fitted

    def fit_lowest(self, points: int, key=lambda ps: ps.bound, eligible=lambda ps: True) -> None:
        """Fit the unfitted ``eligible`` pairs lowest in ``key`` (their step bound, else their
        bytes bound), at least ``points`` points' worth (with every pair tied with the last)."""
        keys = np.concatenate([key(ps)[~ps.fitted & eligible(ps)] for ps in self.spaces])
        sizes = np.concatenate([ps.sizes[~ps.fitted & eligible(ps)] for ps in self.spaces])
        if not len(keys):
            return
        order = np.argsort(keys, kind="stable")
        k = min(int(np.searchsorted(np.cumsum(sizes[order]), points)), len(order) - 1)
        limit = keys[order[k]]
        self.fit(lambda ps: eligible(ps) & (key(ps) <= limit))

    def unfitted_least(self, key=lambda ps: ps.bound, eligible=lambda ps: True) -> float:
        """The lowest ``key`` of an ``eligible`` pair not fitted yet (inf when none is left)."""
        left = [key(ps)[~ps.fitted & eligible(ps)] for ps in self.spaces]
        return min((float(x.min()) for x in left if len(x)), default=np.inf)

    @property
    def total(self) -> int:
        """The candidates: the points fitted, and those in pairs never fitted (their bounds
        ruled them out before their fit was checked)."""
        return len(self.times) + sum(ps.unfitted_points() for ps in self.spaces)

    @property
    def all_fitted(self) -> bool:
        return all(ps.fitted.all() for ps in self.spaces)

    @property
    def band(self) -> float:
        """Step times within the time model's error of the fastest: equally fast to the hedge."""
        return self.best * (1.0 + self.config.time_tolerance)

    def by_layout(self, take: np.ndarray):
        """(one grid of the points among ``take`` of one chunk size, those points) for each
        chunk size ``take`` touches: the grids fitted in turns hold a chunk size's points in
        pieces, and a simulation's cost is mostly per call, not per point."""
        space_of = self.grid_space[self.owner[take]]
        for si in np.unique(space_of):
            rows = take[space_of == si]
            yield self.rows_grid(rows), rows

    def rows_grid(self, rows: np.ndarray) -> CandidateGrid:
        """A grid of points ``rows`` (of one chunk size), in their order."""
        owners = self.owner[rows]
        pieces = np.unique(owners)
        first = self.grids[pieces[0]]
        if len(pieces) == 1:
            return replace(first, **{f: getattr(first, f)[self.local[rows]] for f in _POINT_COLUMNS})
        cols = {}
        for f in _POINT_COLUMNS:
            col = np.empty(len(rows), dtype=getattr(first, f).dtype)
            for gi in pieces:
                m = owners == gi
                col[m] = getattr(self.grids[gi], f)[self.local[rows[m]]]
            cols[f] = col
        return replace(first, **cols)

    def simulate(self, grid: CandidateGrid, rows: np.ndarray, sel: np.ndarray) -> None:
        """Simulate points ``rows[sel]`` (``grid``: ``rows_grid(rows)``) with their most buffers."""
        self.times[rows[sel]], self.speculating[rows[sel]] = simulate_points_speculating(
            self.profile, self.hw, self.config, self.acts, grid, sel)
        self.simulated[rows[sel]] = True
        self.evaluated += len(sel)

    def knobs(self, i: int) -> Knobs:
        g, j = self.grids[self.owner[i]], self.local[i]
        nb = self.fewer_buffers.get(i, (int(g.n_buffer[j]),))[0]
        a = g.a[j]
        return Knobs(chunk_size=g.layout.chunk_bytes, n_persist=int(g.n_persist[j]), n_buffer=nb,
                     n_swap=int(self.acts.n_swap[a]), n_checkpoint=int(self.acts.n_ckpt[a]),
                     n_ssd=int(self.acts.n_ssd[a]), n_selective=int(self.acts.n_sel[a]),
                     n_nvme=int(g.n_nvme[j]), n_shard=int(g.n_shard[j]), head_tile=self.profile.head_tile, mlp_tile=self.profile.mlp_tile,
                     ckpt_input=self.acts.ckpt_input)

    def peak(self, i: int) -> int:
        g, j = self.grids[self.owner[i]], self.local[i]
        return self.fewer_buffers.get(i, (0, int(g.peak[j])))[1]


def search(profile: ModelProfile, hw: HardwareProfile,
           config: PlannerConfig | None = None, *, beat: float = np.inf) -> Plan | None:
    """The fastest plan for ``profile`` on ``hw`` within ``config``'s budgets and pins.
    Raises InfeasibleError (with what would fit) when nothing does. ``beat``: only a plan
    faster than this matters to the caller (an outer loop's incumbent): None when no plan is,
    found without simulating the points whose bounds say they cannot be."""
    config = config or PlannerConfig()
    if (config.pins.sequence_parallel or 1) > 1:
        raise ValueError("search() plans one rank's profile as it is; a sequence-parallel degree "
                         "is chosen by protrain.sp.planner.search_sequence_parallel")
    t0 = time.perf_counter()
    if beat < np.inf and (search_floor(profile, hw, config) > beat * (1 + BOUND_ROUNDING)
                          or activation_free_floor(profile, hw, config) > beat * (1 + BOUND_ROUNDING)):
        return None         # no plan of any chunk size and n_persist can beat it: nothing to build
    hw, budget, caps, acts, spaces = _space(profile, hw, config)
    stats: dict = {}
    st = _SearchState(profile, hw, config, acts, budget, spaces, stats)
    st.best = beat        # the pruning starts from the incumbent: what cannot beat it is skipped
    _find_fastest(st)
    if not len(st.times):
        if not st.all_fitted:
            return None     # the pairs' bounds rule out every point not fitted against ``beat``
        for ps in spaces:
            note_buffers(config, ps.seen, stats)
        raise diagnose_infeasible(profile, hw, config, budget, stats, acts, caps, search=search, fits=fits)
    if not (st.times < beat).any():
        return None
    _simulate_hedge_band(st)
    tied, target = _hedge_ties(st)
    if config.pins.n_buffer is None:
        _fewest_buffers(st, tied, target)
    chosen_i = min(tied, key=lambda i: plan_key(st.times[i], st.peak(i), _tie_order(st.knobs(i))))
    alternatives = _runner_ups(st, chosen_i)
    notes = _notes(st, chosen_i)
    if profile.inplace_blocks:
        notes += (f"no block recomputed: block {profile.inplace_blocks[0]} changes an input in "
                  f"place in forward, which a recompute would see changed",)
    # The count of speculating chunks is the simulation's, unless fewer buffers were tried on
    # the point since (evaluate picks it again then).
    known = int(st.speculating[chosen_i]) if chosen_i not in st.fewer_buffers else None
    return replace(evaluate(profile, hw, st.knobs(chosen_i), config, alternatives=tuple(alternatives),
                            search_seconds=time.perf_counter() - t0, evaluated=st.evaluated,
                            total=st.total, n_speculate=known), notes=notes, fastest_step=float(st.times.min()))


def _space(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig):
    """(the machine within the config's limits, the device budget less the margin, the chunk
    capacities, the activation configurations, a PairSpace per capacity): what a search walks."""
    hw = hw.with_limits(device_memory=config.device_memory, host_memory=config.host_memory)
    budget = hw.device_memory / (1.0 + config.memory_margin)
    caps = candidate_capacities(profile, config)
    acts = activation_configs(profile, config, hw, least_state_drive_time(profile, config, hw, caps, budget))
    return hw, budget, caps, acts, [pair_space(profile, hw, config, acts, cap, budget) for cap in caps]


def fits(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig) -> bool:
    """Whether any point fits ``config``'s budgets and pins (``search`` would find a plan):
    the pairs fitted lowest bound first until one gives a point, nothing simulated."""
    hw, budget, _, acts, spaces = _space(profile, hw, config)
    st = _SearchState(profile, hw, config, acts, budget, spaces, {}, refine_on_fit=False)
    # Twice the points each round: where none fits, every pair is fitted in a few rounds, not
    # one call per pair (a 7B model's diagnosis under a tight host share: 3.5 k calls, 11 s).
    points = 1
    while not len(st.times) and not st.all_fitted:
        st.fit_lowest(points)
        points *= 2
    return bool(len(st.times))


def _find_fastest(st: _SearchState) -> None:
    """The fastest time: points in order of their lower bound until none can beat it, the
    pairs fitted as their bounds come up. A bound is summed in another order than the
    simulation: one a rounding error above the best time may still be a plan tied with it
    (ties go to the lower peak, then the smaller knobs), so it is simulated too."""
    tie = 1 + BOUND_ROUNDING
    batches = 0
    while True:
        nxt = st.unfitted_least()
        open_ = np.flatnonzero(~st.considered)
        if not len(open_) and nxt == np.inf:
            break
        lbs = st.lower_bound
        lowest = min(float(lbs[open_].min()) if len(open_) else np.inf, nxt)
        if lowest > st.best * tie:
            break
        if st.evaluated >= EXACT_SIMULATIONS and lowest >= st.best * (1 - TIE_TOLERANCE):
            st.early = (st.total - int(st.simulated.sum()), (st.best - lowest) / st.best)
            break
        below = open_[lbs[open_] <= nxt] if nxt < np.inf else open_
        batch = min(_FIRST_BATCH, _BATCH) if not batches else _BATCH
        if nxt < np.inf and len(below) < batch:
            st.fit_lowest(_FIT_POINTS)      # a batch in bound order needs the pairs below it
            continue
        if len(below) > 4 * batch:          # the batch's candidates, ties at its edge included
            below = below[lbs[below] <= np.partition(lbs[below], batch - 1)[batch - 1]]
        take = below[np.argsort(lbs[below], kind="stable")[:batch]]
        batches += 1
        st.considered[take] = True
        for g, rows in st.by_layout(take):
            lbs[rows] = refine_cpu_bound(st.profile, st.hw, st.config, st.acts, g, np.arange(len(rows)))
            sel = np.flatnonzero(lbs[rows] <= st.best * tie)  # best only falls: the rest can never win
            if len(sel):
                st.simulate(g, rows, sel)
                st.best = min(st.best, st.times[rows[sel]].min())


def _simulate_hedge_band(st: _SearchState) -> None:
    """The hedge's candidates: points whose bound lies in the band, by bytes moved (known
    without simulating), until the fewest bytes of a plan found in the band is below every
    remaining point's (or equal, and its time below their bounds); the pairs whose bounds say
    they may hold such points fitted as their bytes come up."""
    band = st.band
    st.refine_on_fit = False
    in_band = lambda ps: ps.bound <= band * (1 + BOUND_ROUNDING)    # noqa: E731
    by_bytes = lambda ps: ps.moved                                 # noqa: E731
    batches = 0
    while True:
        found = st.times <= band
        least = st.moved[found].min()
        # A point moving as little as the least found must also be faster than it to win.
        fastest = st.times[found & (st.moved == least)].min() * (1 + BOUND_ROUNDING)
        eligible = lambda ps: in_band(ps) & ((ps.moved < least) | ((ps.moved == least) & (ps.bound <= fastest)))  # noqa: E731,E501
        nxt = st.unfitted_least(by_bytes, eligible)
        lbs = st.lower_bound
        cand = np.flatnonzero(~st.simulated & (lbs <= band) &
                              ((st.moved < least) | ((st.moved == least) & (lbs <= fastest))))
        if not len(cand) and nxt == np.inf:
            break
        below = cand[st.moved[cand] <= nxt] if nxt < np.inf else cand
        batch = min(_FIRST_BATCH, _BATCH) if not batches else _BATCH
        if nxt < np.inf and len(below) < batch:
            st.fit_lowest(_FIT_POINTS, by_bytes, eligible)
            continue
        take = below[np.argsort(st.moved[below], kind="stable")[:batch]]
        batches += 1
        for g, rows in st.by_layout(take):
            lbs[rows] = refine_cpu_bound(st.profile, st.hw, st.config, st.acts, g, np.arange(len(rows)))
            sel = np.flatnonzero(lbs[rows] <= band)     # the others never enter the band
            if len(sel):
                st.simulate(g, rows, sel)


def _hedge_ties(st: _SearchState) -> tuple[list[int], tuple]:
    """The hedge: within the band, the fewest bytes moved, then the fastest. Returns the points
    tied on both and the (bytes, time) they share."""
    in_band = np.flatnonzero(st.times <= st.band)
    first = in_band[np.lexsort((st.times[in_band], st.moved[in_band]))[0]]
    target = (st.moved[first], st.times[first])
    return [int(i) for i in in_band if (st.moved[i], st.times[i]) == target], target


def _fewest_buffers(st: _SearchState, tied: list[int], target: tuple) -> None:
    """Points tied on bytes and time keep the fewest buffers that leave both unchanged (more
    buffers never slow a plan down nor move more). Tied points are refined in order of the
    lowest peak they could reach (their fewest buffers), a batch at a time, bisecting each
    point's buffer count, until none can beat the lowest peak found: a bound-limited dominant
    resource ties thousands of plans exactly."""
    sbuf = planned_state_bytes(st.profile, st.config).buffer
    unit = [sbuf * buffer_numel(g.layout, st.config.data_parallel_size) for g in st.grids]
    grid_of = lambda i: st.grids[st.owner[i]]  # noqa: E731
    at_best = np.array(tied, dtype=np.int64)
    peak_now = np.array([grid_of(i).peak[st.local[i]] for i in at_best], dtype=np.int64)
    spare = np.array([grid_of(i).n_buffer[st.local[i]] - grid_of(i).n_buffer_min[st.local[i]]
                      for i in at_best], dtype=np.int64)
    peak_low = peak_now - spare * np.array([unit[st.owner[i]] for i in at_best], dtype=np.int64)
    best_peak = int(peak_now.min()) if len(at_best) else 0
    order = [k for k in np.argsort(peak_low, kind="stable") if spare[k] > 0]
    for lo in range(0, len(order), 512):
        batch = [k for k in order[lo:lo + 512] if peak_low[k] <= best_peak]
        if not batch:
            break
        for gi in sorted({int(st.owner[at_best[k]]) for k in batch}):
            g = st.grids[gi]
            pts = [int(at_best[k]) for k in batch if st.owner[at_best[k]] == gi]
            high = _bisect_buffers(st, gi, pts, target)
            for i in pts:
                j = st.local[i]
                if high[i] < g.n_buffer[j]:
                    st.fewer_buffers[i] = (high[i], int(g.peak[j] - (g.n_buffer[j] - high[i]) * unit[gi]))
                    best_peak = min(best_peak, st.fewer_buffers[i][1])


def _bisect_buffers(st: _SearchState, gi: int, pts: list[int], target: tuple) -> dict[int, int]:
    """Each point's fewest buffers that keep the target (time and bytes never rise with
    buffers): k evenly spaced counts below the known one per point in one batched simulation
    a round, k as large as a batch allows - a simulation's fixed cost (its loop over parts and
    chunks) far exceeds a row's."""
    g = st.grids[gi]
    gas = st.config.grad_accumulation_steps
    low = {i: int(g.n_buffer_min[st.local[i]]) for i in pts}
    high = {i: int(g.n_buffer[st.local[i]]) for i in pts}
    # Below the fewest buffers that keep every chunk kept now (no more bytes uploaded again
    # in backward), a point moves more bytes and so misses the target: not worth simulating.
    # A 70B model's 23 tied points each kept all 118 chunks: 2,047 simulations ruled out.
    ub, n = chunk_bytes_prefix(g.layout, st.profile, st.config), g.layout.n_chunks
    for i in pts:
        kept_from = max(n - high[i], int(g.n_persist[st.local[i]]))
        same_bytes = int(np.searchsorted(ub, ub[kept_from], side="right")) - 1
        low[i] = max(low[i], n - same_bytes)
    while True:
        active = [i for i in pts if low[i] < high[i]]
        if not active:
            break
        tries = max(2, min(_SWEEP, _BATCH // len(active)))
        rows = [(i, nb) for i in active for nb in
                sorted({low[i] + (high[i] - low[i]) * m // tries for m in range(tries)})]
        idx = np.array([st.local[i] for i, _ in rows])
        nbs = np.array([nb for _, nb in rows])
        t = simulate_points(st.profile, st.hw, st.config, st.acts, g, idx, n_buffer=nbs)
        mv = g.moved[idx] + gas * (
            reupload_bytes(g.layout, st.profile, st.config, g.n_persist[idx], nbs) -
            reupload_bytes(g.layout, st.profile, st.config, g.n_persist[idx], g.n_buffer[idx]))
        st.evaluated += len(rows)
        kept = [(i, nb, (mi, ti) == target) for (i, nb), ti, mi in zip(rows, t, mv)]
        for i, nb, ok in kept:
            if ok:
                high[i] = min(high[i], nb)
        for i, nb, ok in kept:  # the next round searches above the highest failure
            if not ok and nb < high[i]:
                low[i] = max(low[i], nb + 1)
    return high


def _runner_ups(st: _SearchState, chosen_i: int) -> list[Alternative]:
    """The fastest other plans (one per activation configuration and chunk size)."""
    done = np.flatnonzero(np.isfinite(st.times))
    peaks = np.array([st.peak(i) for i in done])
    order = [i for i in done[np.lexsort((peaks, st.times[done]))] if i != chosen_i]
    shape = lambda k: (k.chunk_size, k.n_checkpoint, k.n_swap, k.n_ssd, k.n_selective)  # noqa: E731
    alternatives, seen = [], {shape(st.knobs(chosen_i))}
    for i in order:
        if len(alternatives) >= st.config.runner_ups:
            break
        k = st.knobs(i)
        if shape(k) in seen:
            continue
        seen.add(shape(k))
        g, j = st.grids[st.owner[i]], st.local[i]
        alternatives.append(Alternative(knobs=k, iter_time=float(st.times[i]),
                                        peak_device_bytes=st.peak(i), host_bytes=int(g.host[j])))
    return alternatives


def _notes(st: _SearchState, chosen_i: int) -> tuple[str, ...]:
    """What the plan's notes say: the hedge changed the choice, the search stopped early."""
    notes = ()
    done = np.flatnonzero(np.isfinite(st.times))
    fastest = min(done, key=lambda i: (st.times[i], st.moved[i]))
    if st.moved[chosen_i] < st.moved[fastest]:
        notes = (f"hedged: plans predicted within the runtime model's {st.config.time_tolerance:.0%} "
                 f"error band of the fastest ({fmt_seconds(float(st.best))}/step) count as equally "
                 f"fast; this one ({fmt_seconds(float(st.times[chosen_i]))}) moves the fewest bytes, "
                 f"{fmt_bytes(int(st.moved[chosen_i]))} per step against {fmt_bytes(int(st.moved[fastest]))} "
                 f"for the fastest",)
    if st.early is not None:
        notes += (f"search stopped after {st.evaluated} simulations: the {st.early[0]} candidates not "
                  f"simulated could be at most {st.early[1]:.4%} faster",)
    return notes
